"""Overhead of the allhands loop against a minimal hand-written torch DDP loop and the same loop
under Lightning Fabric (when installed: the ``bench`` extra).

Same model (the reference GPT), same global batch, same 2 gloo ranks, same data; the loops
alternate inside the same worker processes (ROUNDS rounds of STEPS steps each, the order
rotating from round to round), so machine noise hits all alike. allhands logs at its default
``log.interval``, as a user's run does (the hand-written and Fabric loops log nothing). A step's
time is the wall time between two consecutive steps' ends, so it
holds everything the loop does once per step; a round's figure is the mean over its steps after
the first two (a mean, not a median, so a cost paid on one step in ten still counts), in wall
time and in CPU time of rank 0's process (all its threads; other jobs on a shared machine
inflate it far less than wall time). Figure: the median over rounds, allhands / hand-written and
allhands / Fabric, at each global batch. Target <= 1.00.

    python bench/overhead.py [--rounds 5] [--steps 30] [--global-batch 16 4]
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


def handwritten_steps(cfg, mesh, train_ds, steps: int, fabric=None, params: list | None = None) -> list:
    """The minimal loop: random batch, forward, backward (DDP all-reduce), clip, AdamW step.

    ``fabric``: the same loop under Lightning Fabric (``fabric.setup`` wraps the model in its
    DDP, ``fabric.backward``, ``fabric.clip_gradients``): the two differ only in those three
    calls. ``params``: receives the trained parameters (tests compare the two loops)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from allhands.job import build_reference_model

    torch.manual_seed(0)
    model = build_reference_model(cfg, 257)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    if fabric is None:
        model = DDP(model)
        backward = torch.Tensor.backward

        def clip():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
        model, opt = fabric.setup(model, opt)
        backward = fabric.backward

        def clip():
            fabric.clip_gradients(model, opt, max_norm=1.0)
    per_rank = cfg.run.global_batch // mesh.world_size
    g = torch.Generator().manual_seed(mesh.rank)
    stamps = []
    for _ in range(steps):
        idx = torch.randint(len(train_ds), (per_rank,), generator=g).tolist()
        x = torch.stack([train_ds[i][0] for i in idx])
        y = torch.stack([train_ds[i][1] for i in idx])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        backward(loss)
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append((time.perf_counter(), time.process_time()))
    if params is not None:
        params.extend(p.detach().clone() for p in model.parameters())
    return _deltas(stamps)


def make_fabric(world_size: int):
    """Lightning Fabric's DDP on CPU over the process group this rank already joined (Fabric
    finds torch elastic's environment and keeps an initialised group), or None without it."""
    try:
        from lightning.fabric import Fabric  # optional: pip install 'allhands[bench]'
    except ImportError:
        return None
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=world_size, num_nodes=1)
    fabric.launch()
    return fabric


def _deltas(stamps: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each step: between consecutive steps' ends."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(stamps, stamps[1:])]


def allhands_steps(cfg, mesh, run_dir: Path) -> list[float]:
    from allhands.trainer import Job, Trainer

    trainer = Trainer(cfg, Job(), mesh, run_dir)
    stamps, after_step = [], trainer.strategy.after_step

    def stamped(step: int) -> None:  # once per step, at the same point of every iteration
        after_step(step)
        stamps.append((time.perf_counter(), time.process_time()))

    trainer.strategy.after_step = stamped
    trainer.fit()
    return _deltas(stamps)


def worker(cfg_dicts: list[dict], rounds: int, steps: int, out: str) -> None:
    import json

    from allhands.config import Config
    from allhands.env import worker_env
    from allhands.data import load_token_splits
    from allhands.mesh import Mesh

    cfg = Config.from_dict(cfg_dicts[0])
    env = worker_env()
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, device="cpu",
                      backend="gloo", dp_replicate=-1, timeout_s=120)
    import torch

    torch.set_num_threads(1)
    train_ds, _, _ = load_token_splits(cfg.data.path, cfg.model.seq_len)
    fabric = make_fabric(mesh.world_size)
    names = ("allhands", "handwritten") + (("fabric",) if fabric is not None else ())
    results = {}
    for cfg_dict in cfg_dicts:
        cfg = Config.from_dict(cfg_dict)
        res = results.setdefault(str(cfg.run.global_batch), {k: [] for n in names for k in (n, n + "_cpu")})
        for r in range(rounds):
            cfg.run.dir = f"{out}/gb{cfg.run.global_batch}-round{r}"
            Path(cfg.run.dir).mkdir(exist_ok=True)
            runs = {"allhands": lambda: allhands_steps(cfg, mesh, Path(cfg.run.dir)),
                    "handwritten": lambda: handwritten_steps(cfg, mesh, train_ds, steps),
                    "fabric": lambda: handwritten_steps(cfg, mesh, train_ds, steps, fabric)}
            for name in names[r % len(names):] + names[:r % len(names)]:  # the order rotates
                steps_ = runs[name]()[2:]
                if mesh.rank == 0:
                    res[name].append(statistics.mean(w for w, _ in steps_))
                    res[name + "_cpu"].append(statistics.mean(c for _, c in steps_))
    if mesh.rank == 0:
        Path(out, "result.json").write_text(json.dumps(results))
    mesh.destroy()


def main() -> None:
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-batch", type=int, nargs="+", default=[16, 4])
    args = ap.parse_args()

    from allhands.config import load_config
    from allhands.launch.launcher import LaunchSpec, launch
    from allhands.launch.rundir import resolve_run

    out = tempfile.mkdtemp(prefix="allhands-bench-overhead-")
    cfgs = [resolve_run(load_config(overrides=[
        *MODEL, f"run.steps={args.steps}", f"run.global_batch={gb}",
        *TIMING_ONLY, f"run.dir={out}/resolve{gb}"]), resume=None, world_size=2).to_dict()
        for gb in args.global_batch]
    launch(worker, (cfgs, args.rounds, args.steps, out), LaunchSpec(nproc=2))
    print(f"rounds={args.rounds} steps/round={args.steps} ranks=2 model={' '.join(MODEL)} "
          f"log.interval={cfgs[0]['log']['interval']} (the default)")
    for gb, res in json.loads(Path(out, "result.json").read_text()).items():
        peers = [n for n in ("handwritten", "fabric") if n in res]
        print(f"global batch {gb}: per-round mean step (s): " + "; ".join(
            f"{n} " + " ".join(f"{v:.4f}" for v in res[n]) for n in ("allhands", *peers)))
        a, ac = statistics.median(res["allhands"]), statistics.median(res["allhands_cpu"])
        for n in peers:
            h, hc = statistics.median(res[n]), statistics.median(res[n + "_cpu"])
            # Per round, allhands / peer of the same round: its spread says whether a ratio a
            # little above 1 is a cost or the machine (2 standard errors of the mean).
            paired = [x / y for x, y in zip(res["allhands"], res[n])]
            se2 = 2 * statistics.stdev(paired) / len(paired) ** 0.5 if len(paired) > 1 else float("nan")
            print(f"global batch {gb}: overhead ratio allhands/{n} = {a / h:.3f} wall, "
                  f"{ac / hc:.3f} CPU of rank 0's process (target <= 1.00); per-round paired "
                  f"{statistics.fmean(paired):.3f} +- {se2:.3f} wall ({min(paired):.3f}..{max(paired):.3f})")
        if "fabric" not in res:
            print("Lightning Fabric: not installed (pip install 'allhands[bench]'), not measured")


if __name__ == "__main__":
    main()
