"""Overhead of the allhands loop against a minimal hand-written torch DDP loop.

Same model (the reference GPT), same global batch, same 2 gloo ranks, same data; the two loops
alternate inside the same worker processes (ROUNDS rounds of STEPS steps each), so machine noise
hits both alike. Figure: median wall time per step, allhands / hand-written. Target <= 1.03.

    python bench/overhead.py [--rounds 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import TIMING_ONLY  # noqa: E402  (bench/ is sys.path[0])

MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.seq_len=128"]


def handwritten_steps(cfg, mesh, train_ds, steps: int) -> list[float]:
    """The minimal loop: random batch, forward, backward (DDP all-reduce), clip, AdamW step."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from allhands.job import build_reference_model

    torch.manual_seed(0)
    model = DDP(build_reference_model(cfg, 257))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    per_rank = cfg.run.global_batch // mesh.world_size
    g = torch.Generator().manual_seed(mesh.rank)
    stamps = []
    for _ in range(steps):
        idx = torch.randint(len(train_ds), (per_rank,), generator=g).tolist()
        x = torch.stack([train_ds[i][0] for i in idx])
        y = torch.stack([train_ds[i][1] for i in idx])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def allhands_steps(cfg, mesh, run_dir: Path) -> list[float]:
    import json

    from allhands.trainer import Job, Trainer

    Trainer(cfg, Job(), mesh, run_dir).fit()
    if mesh.rank != 0:
        return []
    stamps = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return [b - a for a, b in zip(stamps, stamps[1:])]


def worker(cfg_dict: dict, rounds: int, steps: int, out: str) -> None:
    import json

    from allhands.config import Config
    from allhands.env import worker_env
    from allhands.data import load_token_splits
    from allhands.mesh import Mesh

    cfg = Config.from_dict(cfg_dict)
    env = worker_env()
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, device="cpu",
                      backend="gloo", dp_replicate=-1, timeout_s=120)
    import torch

    torch.set_num_threads(1)
    train_ds, _, _ = load_token_splits(cfg.data.path, cfg.model.seq_len)
    results = {"allhands": [], "handwritten": []}
    for r in range(rounds):
        cfg.run.dir = f"{out}/round{r}"
        Path(cfg.run.dir).mkdir(exist_ok=True)
        a = allhands_steps(cfg, mesh, Path(cfg.run.dir))
        h = handwritten_steps(cfg, mesh, train_ds, steps)
        if mesh.rank == 0:
            results["allhands"].append(statistics.median(a[2:]))
            results["handwritten"].append(statistics.median(h[2:]))
    if mesh.rank == 0:
        Path(out, "result.json").write_text(json.dumps(results))
    mesh.destroy()


def main() -> None:
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()

    from allhands.config import load_config
    from allhands.launch.launcher import LaunchSpec, launch
    from allhands.launch.rundir import resolve_run

    out = tempfile.mkdtemp(prefix="allhands-bench-overhead-")
    cfg = load_config(overrides=[*MODEL, f"run.steps={args.steps}", "run.global_batch=32",
                                 *TIMING_ONLY, f"run.dir={out}/resolve"])
    cfg = resolve_run(cfg, resume=None, world_size=2)
    launch(worker, (cfg.to_dict(), args.rounds, args.steps, out), LaunchSpec(nproc=2))
    res = json.loads(Path(out, "result.json").read_text())
    a, h = statistics.median(res["allhands"]), statistics.median(res["handwritten"])
    print(f"rounds={args.rounds} steps/round={args.steps} ranks=2 model={' '.join(MODEL)} global_batch=32")
    print("per-round median step (s): allhands " + " ".join(f"{v:.4f}" for v in res["allhands"]))
    print("per-round median step (s): handwritten " + " ".join(f"{v:.4f}" for v in res["handwritten"]))
    print(f"overhead ratio allhands/handwritten = {a / h:.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
