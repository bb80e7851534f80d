"""Data-parallel scaling on this machine: throughput on 2 ranks / (2 x throughput on 1 rank).

Weak scaling (the same per-rank batch), a compute-bound reference GPT, 1 thread per rank, and
the 1-rank and 2-rank jobs alternated ROUNDS times so noise hits both. Throughput comes from the
wall-clock stamps of consecutive steps in metrics.jsonl (the whole loop, communication included).
Target >= 0.90 (Horovod's published efficiency at 512 GPUs).

    python bench/scaling.py [--rounds 3] [--steps 25]
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

MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.seq_len=128"]
PER_RANK_BATCH = 16


def samples_per_s(run_dir: Path, global_batch: int) -> float:
    stamps = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    steps = [b - a for a, b in zip(stamps, stamps[1:])][2:]
    return global_batch / statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    args = ap.parse_args()

    from allhands.config import load_config
    from allhands.launch.launcher import LaunchSpec, train_job

    out = Path(tempfile.mkdtemp(prefix="allhands-bench-scaling-"))
    rates: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.rounds):
        for n in (1, 2):
            gb = PER_RANK_BATCH * n
            cfg = load_config(overrides=[*MODEL, f"run.steps={args.steps}", f"run.global_batch={gb}",
                                         *TIMING_ONLY, f"run.dir={out}/r{r}-n{n}"])
            done = train_job(cfg, LaunchSpec(nproc=n))
            rates[n].append(samples_per_s(Path(done.run.dir), gb))
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"rounds={args.rounds} steps={args.steps} model={' '.join(MODEL)} per-rank batch={PER_RANK_BATCH}")
    print("samples/s on 1 rank: " + " ".join(f"{v:.1f}" for v in rates[1]))
    print("samples/s on 2 ranks: " + " ".join(f"{v:.1f}" for v in rates[2]))
    print(f"scaling efficiency = {two / (2 * one):.3f} (target >= 0.90)")


if __name__ == "__main__":
    main()
