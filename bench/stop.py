"""How fast a stop signal ends a job: `allhands train` (2 CPU workers, a small GPT) is sent
SIGTERM or SIGUSR1 once step 10 is logged; figures per signal and checkpoint mode:

- committed: from the signal to the stop checkpoint's ``allhands.json`` (finish the step, agree,
  save, commit);
- exit: from the signal to the launcher's exit with its one line (workers' exit, the agent's
  monitor, the launcher's own teardown).

    python bench/stop.py [--out runs/bench-stop]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", "model.seq_len=64"]
JOB = ["run.steps=100000", "run.global_batch=8", "log.interval=1", "log.progress=false",
       "log.tensorboard=false", "checkpoint.interval=0", "run.eval_interval=0"]


def logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def one(out: Path, sig: signal.Signals, mode: str) -> str:
    run = out / f"{sig.name}-{mode}"
    shutil.rmtree(run, ignore_errors=True)
    sets = [f"--set={s}" for s in (*MODEL, *JOB, f"checkpoint.mode={mode}", f"run.dir={run}")]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.Popen([sys.executable, "-m", "allhands.cli", "train", "--nproc", "2", *sets],
                         env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    while 10 not in logged(run):
        if p.poll() is not None:
            raise SystemExit(p.communicate()[1])
        time.sleep(0.02)
    at, t0, wall0 = logged(run)[-1], time.monotonic(), time.time()
    p.send_signal(sig)
    _, err = p.communicate()
    exit_s = time.monotonic() - t0
    meta = sorted((run / "checkpoints").glob("step-*"))[-1] / "allhands.json"
    line = next(l for l in err.splitlines() if "stopped" in l or "for requeue" in l)
    return (f"{sig.name:8} checkpoint.mode={mode:5}  step {at} logged when signalled; committed "
            f"{meta.stat().st_mtime - wall0:.2f} s, exit {p.returncode} after {exit_s:.2f} s\n  {line}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-stop"))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    for sig, mode in ((signal.SIGTERM, "sync"), (signal.SIGTERM, "async"), (signal.SIGUSR1, "async")):
        print(one(out, sig, mode), flush=True)


if __name__ == "__main__":
    main()
