"""Whole process, start to exit: ``allhands train`` against ``torchrun`` + a raw DDP script
(bench/raw_ddp.py), same GPT, same steps, same global batch, 2 CPU workers, nothing but the
steps (no evaluation, no checkpoint, no progress bar). The two commands alternate, ROUNDS times;
figure: the median wall time, allhands / torchrun. Target <= 1.02. One allhands round runs
with ``--verbose``, whose phase lines (command -> first step) are printed as they came.

    python bench/startup.py [--rounds 5] [--steps 35] [--global-batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import TIMING_ONLY  # noqa: E402

MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "seq_len": 128}


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return took, p.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=35)
    ap.add_argument("--global-batch", type=int, default=16)
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    out = Path(tempfile.mkdtemp(prefix="allhands-bench-startup-"))
    sets = [*(f"model.{k}={v}" for k, v in MODEL.items()), f"run.steps={a.steps}",
            f"run.global_batch={a.global_batch}", "run.threads=1", *TIMING_ONLY]
    raw = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "bench" / "raw_ddp.py"), "--steps", str(a.steps), "--global-batch",
           str(a.global_batch), "--layers", str(MODEL["n_layer"]), "--heads", str(MODEL["n_head"]),
           "--width", str(MODEL["n_embd"]), "--seq", str(MODEL["seq_len"])]
    times: dict[str, list[float]] = {"allhands": [], "torchrun": []}
    phases = ""
    for r in range(a.rounds):
        ours = [sys.executable, "-m", "allhands.cli", "train", "--nproc", "2",
                *(["--verbose"] if r == 0 else []),
                *(x for s in [*sets, f"run.dir={out}/run{r}"] for x in ("--set", s))]
        for name, cmd in (("allhands", ours), ("torchrun", raw)) if r % 2 == 0 else \
                (("torchrun", raw), ("allhands", ours)):
            took, err = timed(cmd, env)
            times[name].append(took)
            if name == "allhands" and r == 0:
                phases = "\n".join(line for line in err.splitlines() if " took " in line)
    print(f"rounds={a.rounds} steps={a.steps} global_batch={a.global_batch} ranks=2 "
          f"model={' '.join(f'{k}={v}' for k, v in MODEL.items())}")
    for name, ts in times.items():
        print(f"{name}: wall s per round " + " ".join(f"{t:.2f}" for t in ts))
    ratio = statistics.median(times["allhands"]) / statistics.median(times["torchrun"])
    print(f"whole process allhands/torchrun = {ratio:.3f} (target <= 1.02)")
    print("allhands --verbose phases (round 0):\n" + phases)


if __name__ == "__main__":
    main()
