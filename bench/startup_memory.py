"""Peak memory per rank before the first step: the llama3.2-1b preset on 2 gloo ranks under
ZeRO-3 (``parallel.zero=3``) and under two pipeline stages (``parallel.pp=2``).

Each rank builds a real ``Trainer`` (data, model, layout, optimizer: everything before step 1;
AdamW's state is created by the first step) in a worker the launcher starts. Measured per rank:
the growth of its resident set from just before the Trainer to its high-water mark after it
(VmHWM, reset to the current RSS first through /proc/self/clear_refs), over the full model's
fp32 bytes. Side by side, in the same run: the shipped path (built on the meta device, each rank
allocating and initialising only its cut: models/init.py) and the whole model built on every
rank first, as a model the Python API is handed still is (``Job(model=...)``), as every random
initialisation was before. Also printed: the share of the model the rank holds (its floor: a
tied embedding sits on both the first and the last pipeline stage) and the peak over it.
Target for the shipped path: <= 0.60.

    python bench/startup_memory.py [--preset llama3.2-1b] [--no-whole]

Needs Linux and, for llama3.2-1b, about 3.5 GiB per rank (6 GiB with the whole build); 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import TIMING_ONLY  # noqa: E402

LAYOUTS = {"zero3": ["parallel.dp_shard=2", "parallel.zero=3"],
           "pp2": ["parallel.pp=2", "parallel.dp_replicate=1"]}
TARGET = 0.60


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (this bench needs Linux)")


def worker(cfg_dict: dict, whole: bool, out: str) -> None:
    import torch

    from allhands.config import Config
    from allhands.env import worker_env
    from allhands.job import build_reference_model
    from allhands.lockstep import build_mesh
    from allhands.models.init import local_block
    from allhands.trainer import Job, Trainer

    cfg = Config.from_dict(cfg_dict)
    mesh = build_mesh(cfg, worker_env())
    # a user's builder: the trainer builds it whole on every rank and then cuts it
    job = Job(model=lambda c: build_reference_model(c, 257)) if whole else Job()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    trainer = Trainer(cfg, job, mesh, Path(cfg.run.dir))
    took = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    held = sum(local_block(p)[0].numel() * p.element_size()
               for part in trainer.parts for p in part.parameters())
    with torch.device("meta"):
        full = sum(p.numel() * p.element_size() for p in build_reference_model(cfg, 257).parameters())
    Path(out, f"rank{mesh.rank}.json").write_text(json.dumps(
        {"grow": (peak - before) * 1024, "held": held, "full": full, "seconds": took}))
    mesh.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--no-whole", action="store_true", help="skip the whole-model comparison")
    args = ap.parse_args()

    from allhands.config import Config, apply_override
    from allhands.data import prepare
    from allhands.data.shards import embedded_text
    from allhands.launch.launcher import LaunchSpec, launch
    from allhands.launch.rundir import resolve_run

    tmp = Path(tempfile.mkdtemp(prefix="allhands-bench-startup-memory-"))
    prepare(embedded_text().split("\n\n")[:300], tmp / "tokens", val_fraction=0.1)
    print(f"model.preset={args.preset}, 2 ranks, 1 thread each; peak RSS growth before step 1 "
          f"over the full model's fp32 bytes")
    print(f"{'layout':7} {'build':29} {'rank':>4} {'peak GiB':>9} {'model GiB':>10} {'ratio':>6} "
          f"{'holds':>6} {'peak/holds':>10} {'build s':>8}  verdict (ratio <= {TARGET:.2f})")
    for name, layout in LAYOUTS.items():
        for whole in ((False,) if args.no_whole else (False, True)):
            run = tmp / f"{name}-{'whole' if whole else 'meta'}"
            cfg = Config()
            for item in (*TIMING_ONLY, f"model.preset={args.preset}", "model.seq_len=16",
                         "run.global_batch=2", "run.steps=1", "run.threads=1",
                         f"data.path={tmp / 'tokens'}", f"run.dir={run}", *layout):
                apply_override(cfg, item)
            cfg = resolve_run(cfg, resume=None, world_size=2)
            out = tmp / f"out-{run.name}"
            out.mkdir()
            launch(worker, (cfg.to_dict(), whole, str(out)), LaunchSpec(nproc=2), threads=1)
            for r in range(2):
                got = json.loads((out / f"rank{r}.json").read_text())
                ratio = got["grow"] / got["full"]
                label = "whole on every rank, then cut" if whole else "meta, each rank its cut"
                verdict = "" if whole else ("met" if ratio <= TARGET else "NOT met")
                if verdict == "NOT met" and got["held"] / got["full"] > TARGET:
                    verdict += " (the rank's own share is above it)"
                print(f"{name:7} {label:29} {r:>4} {got['grow'] / 2**30:9.2f} "
                      f"{got['full'] / 2**30:10.2f} {ratio:6.3f} {got['held'] / got['full']:6.3f} "
                      f"{got['grow'] / got['held']:10.3f} {got['seconds']:8.1f}  {verdict}", flush=True)


if __name__ == "__main__":
    main()
