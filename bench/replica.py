"""Replica mode against restart mode, side by side, on one fault schedule.

A 2-worker job (reference GPT, as bench/recovery.py) runs undisturbed, then with a SIGKILL of
worker (replica group) 1 every ``--every`` steps, once with ``fault.mode = "replica"`` and once
with ``fault.mode = "restart"`` (async checkpoints every ``--ckpt`` steps). Figures per fault:

- survivor stall (replica): from the SIGKILL to group 0's next completed step;
- replacement back (replica): from the SIGKILL to the restarted group 1's first completed step
  (its start-up, the quorum, the heal);
- recovery (restart): from the SIGKILL to the restarted job's next completed step;
- goodput: ``run.steps`` x the undisturbed median step time / wall time of the faulted run from
  its first step to its last.

    python bench/replica.py [--faults 2] [--every 50] [--ckpt 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODEL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", "model.seq_len=64"]


def steps_of(path: Path) -> list[tuple[int, float, float]]:
    """(step, wall time, step_time) of every training line of a metrics.jsonl."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["time"], r["step_time"]) for r in rows if "loss" in r and "time" in r]


def after(rows: list[tuple[int, float, float]], t: float) -> float | None:
    later = [w for _, w, _ in rows if w > t]
    return min(later) - t if later else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--faults", 2), ("--every", 50), ("--ckpt", 10)):
        ap.add_argument(flag, type=int, default=default)
    args = ap.parse_args()

    from allhands.config import load_config
    from allhands.faults import fired_at
    from allhands.launch.launcher import LaunchSpec, train_job

    out = Path(tempfile.mkdtemp(prefix="allhands-bench-replica-"))
    steps = args.every * (args.faults + 1)
    inject = ",".join(f"1:{args.every * (i + 1)}:SIGKILL" for i in range(args.faults))
    base = [*MODEL, f"run.steps={steps}", "run.global_batch=16", "run.eval_interval=0",
            "data.eval_batches=0", f"checkpoint.interval={args.ckpt}", "fault.backoff_s=0.5",
            "log.tensorboard=false", "log.progress=false", f"fault.max_restarts={args.faults + 1}"]
    runs = {"undisturbed": ["fault.mode=replica"], "replica": ["fault.mode=replica", f"fault.inject={inject}"],
            "restart": ["fault.mode=restart", f"fault.inject={inject}"]}
    print(f"faults={args.faults} every={args.every} steps={steps} checkpoint every {args.ckpt} workers=2 "
          f"model={' '.join(MODEL)} global_batch=16 in {out}", flush=True)
    rows = {}
    for name, extra in runs.items():
        cfg = load_config(overrides=[*base, *extra, f"run.dir={out / name}"])
        train_job(cfg, LaunchSpec(nproc=2))
        rows[name] = steps_of(out / name / "metrics.jsonl")
    step_time = statistics.median(dt for _, _, dt in rows["undisturbed"])
    print(f"undisturbed median step time {step_time:.3f} s")
    for name in ("replica", "restart"):
        kills = sorted(t for k, t in fired_at(out / name).items())
        first, last = rows[name][0][1] - rows[name][0][2], rows[name][-1][1]
        goodput = steps * step_time / (last - first)
        stalls = [after(rows[name], t) for t in kills]
        line = f"{name}: goodput {goodput:.2f}; " + ("survivor stall" if name == "replica" else "recovery")
        line += " " + ", ".join(f"{s:.2f} s" if s is not None else "none" for s in stalls)
        if name == "replica":
            g1 = steps_of(out / name / "replicas" / "group-1" / "metrics.jsonl")
            back = [after(g1, t) for t in kills]
            line += "; replacement back " + ", ".join(f"{b:.2f} s" if b is not None else "never" for b in back)
        print(line, flush=True)


if __name__ == "__main__":
    main()
