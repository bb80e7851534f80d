"""Step time of ``run.compile`` (torch.compile per transformer block, inductor's C++ backend on
CPU) against eager, for the tiny reference GPT of the tests and a slightly larger one, side by
side in one run: each model trains ``--steps`` steps on 1 worker eager, then compiled, through
the launcher; the figure is the median step time after the first ``--warmup`` steps (the
compiled run's first steps are compilation), and the ratio compiled / eager (< 1: compile wins).

    python bench/compile.py [--steps 30] [--warmup 8]

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


def median_step(items: list[str], run_dir: Path, steps: int, warmup: int) -> float:
    cfg = Config()
    for item in (*items, *TIMING_ONLY, "model.bias=false", "log.interval=1", f"run.steps={steps}",
                 "optim.warmup_steps=2", f"run.dir={run_dir}"):
        apply_override(cfg, item)
    done = train_job(cfg, LaunchSpec(nproc=1))
    rows = [json.loads(x) for x in (Path(done.run.dir) / "metrics.jsonl").read_text().splitlines() if x]
    return statistics.median(r["step_time"] for r in rows if "loss" in r and r["step"] > warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory(prefix="allhands-bench-compile-") as tmp:
        for i, (name, items) in enumerate(MODELS.items()):
            eager = median_step(items, Path(tmp) / f"{i}-eager", args.steps, args.warmup)
            comp = median_step([*items, "run.compile=true"], Path(tmp) / f"{i}-compiled", args.steps, args.warmup)
            out.append((name, eager, comp))
    print(f"\n{'model':<34} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15}")
    for name, eager, comp in out:
        print(f"{name:<34} {1e3 * eager:>9.2f} {1e3 * comp:>12.2f} {comp / eager:>15.2f}")
    print(f"(1 CPU worker; median step time after step {args.warmup} of {args.steps})")


if __name__ == "__main__":
    main()
