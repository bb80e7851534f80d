"""Step time of ``run.compile`` (torch.compile per transformer block, inductor's C++ backend on
CPU) against eager, side by side in one run: the tiny reference GPT of the tests and a slightly
larger one on 1 worker, then the larger one under each 2-worker layout of ``LAYOUTS`` (DDP,
ZeRO-3, tp=2, pp=2). Each trains ``--steps`` steps eager, then compiled, through the launcher; the
figure is the median step time after the first ``--warmup`` steps (the compiled run's first
steps are compilation), and the ratio compiled / eager (< 1: compile wins).

    python bench/compile.py [--steps 30] [--warmup 8] [--layouts ddp,zero3,tp2,pp2]

Needs a C++ compiler (gcc or clang) for inductor on CPU.
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

from common import TIMING_ONLY  # noqa: E402  (bench/ is sys.path[0])

from allhands.config import Config, apply_override  # noqa: E402
from allhands.launch.launcher import LaunchSpec, train_job  # noqa: E402

MODELS = {
    "tiny (2 x 32, T 16, batch 12)": ["model.n_layer=2", "model.n_head=2", "model.n_embd=32",
                                      "model.seq_len=16", "run.global_batch=12"],
    "small (4 x 128, T 64, batch 16)": ["model.n_layer=4", "model.n_head=4", "model.n_embd=128",
                                        "model.seq_len=64", "run.global_batch=16"],
}


LAYOUTS = {
    "ddp": [],
    "zero3": ["parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.zero=3"],
    "tp2": ["parallel.dp_replicate=1", "parallel.tp=2"],
    "pp2": ["parallel.dp_replicate=1", "parallel.pp=2", "parallel.pp_schedule=1f1b"],
}


def median_step(items: list[str], run_dir: Path, steps: int, warmup: int, nproc: int = 1) -> float:
    cfg = Config()
    for item in (*items, *TIMING_ONLY, "model.bias=false", "log.interval=1", f"run.steps={steps}",
                 "optim.warmup_steps=2", f"run.dir={run_dir}"):
        apply_override(cfg, item)
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    rows = [json.loads(x) for x in (Path(done.run.dir) / "metrics.jsonl").read_text().splitlines() if x]
    return statistics.median(r["step_time"] for r in rows if "loss" in r and r["step"] > warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="2-worker layouts of the larger model "
                    "(comma-separated; empty: only the 1-worker runs)")
    args = ap.parse_args()
    runs = [(name, items, 1) for name, items in MODELS.items()]
    small = list(MODELS.values())[-1]
    runs += [(f"small, 2 workers, {lay}", [*small, *LAYOUTS[lay]], 2) for lay in args.layouts.split(",") if lay]
    out = []
    with tempfile.TemporaryDirectory(prefix="allhands-bench-compile-") as tmp:
        for i, (name, items, nproc) in enumerate(runs):
            eager = median_step(items, Path(tmp) / f"{i}-eager", args.steps, args.warmup, nproc)
            comp = median_step([*items, "run.compile=true"], Path(tmp) / f"{i}-compiled", args.steps,
                               args.warmup, nproc)
            out.append((name, eager, comp))
    print(f"\n{'model':<34} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15}")
    for name, eager, comp in out:
        print(f"{name:<34} {1e3 * eager:>9.2f} {1e3 * comp:>12.2f} {comp / eager:>15.2f}")
    print(f"(CPU workers; median step time after step {args.warmup} of {args.steps})")


if __name__ == "__main__":
    main()
