"""Recovery time and goodput under faults, through ``allhands drill``.

A 2-rank job (reference GPT, async checkpoints every ``--ckpt`` steps) runs undisturbed, then with
a SIGKILL every ``--every`` steps (alternating ranks, mid-step), recovering automatically. Figures:

- recovery: from the SIGKILL to the restarted job's next completed step (detection, teardown,
  backoff, new workers, rendezvous, checkpoint load, first step), median over the faults.
  Target <= 15 s on this machine.
- goodput: useful step time (``run.steps`` x the undisturbed median step time) / wall time of the
  faulted run from its first step to its last.

    python bench/recovery.py [--faults 3] [--every 50] [--ckpt 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODEL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", "model.seq_len=64"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faults", type=int, default=3)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--ckpt", type=int, default=10)
    args = ap.parse_args()

    from allhands.config import load_config
    from allhands.drill import run_drill
    from allhands.faults import Fault
    from allhands.launch.launcher import LaunchSpec

    out = Path(tempfile.mkdtemp(prefix="allhands-bench-recovery-"))
    steps = args.every * (args.faults + 1)
    cfg = load_config(overrides=[*MODEL, f"run.steps={steps}", "run.global_batch=16", "run.eval_interval=0",
                                 "data.eval_batches=0", f"checkpoint.interval={args.ckpt}",
                                 "fault.backoff_s=0.5", "log.tensorboard=false", f"run.dir={out}"])
    plan = [Fault(args.every * (i + 1), i % 2, "SIGKILL") for i in range(args.faults)]
    print(f"faults={args.faults} every={args.every} steps={steps} checkpoint every {args.ckpt} ranks=2 "
          f"model={' '.join(MODEL)} global_batch=16 backoff=0.5 s")
    equal = run_drill(cfg, LaunchSpec(nproc=2), faults=args.faults, seed=0, plan=plan)
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
