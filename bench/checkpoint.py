"""Training stall per checkpoint, asynchronous vs synchronous, and the steady overhead of
checkpointing every N steps.

Two gloo ranks train the reference GPT with DDP + AdamW (the allhands state: model, optimizer,
step, RNG) and save through allhands' Checkpointer. Each round runs four series of
``--blocks`` x ``--interval`` steps in the same processes: no save (baseline), an async save after
each block (the series ends when its last write is committed), the same with the writer thread
at nice 0 instead of allhands' ``WRITER_NICE`` ("async0", to show what the lower priority buys),
and sync saves. The order rotates from round to round, so machine noise and warm-up hit all
alike; figures are medians over the rounds, overheads the median of per-round paired ratios. One save per mode before the rounds prepares the
directories and the host buffers. Figures:

- stall: wall time the training thread is blocked by a save: inside ``Checkpointer.save`` (sync:
  the whole DCP write, manifest, fsync and rename; async: taking the state dicts, plus any wait
  for the previous save, which the one-in-flight rule imposes) plus, async, the wait in
  ``before_update`` for the rest of the copy to host memory. Target: sync / async >= 10.
- overhead: (series time with async saves - baseline series time) / baseline series time: a save
  every ``--interval`` steps. Target <= 2%. Also printed: the cost of one save that this implies
  (seconds) and the interval ``checkpoint.max_overhead`` would pick from it for a 2% bound.

    python bench/checkpoint.py [--rounds 6] [--interval 20] [--blocks 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.seq_len=64"]


def worker(cfg_dict: dict, rounds: int, interval: int, blocks: int, out: str) -> None:
    import json

    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import allhands.checkpoint as ckpt_mod
    from allhands.checkpoint import Checkpointer, ModelOptimState, RNGState, TrainState
    from allhands.config import Config
    from allhands.data import load_token_splits
    from allhands.launch import worker_env
    from allhands.mesh import Mesh
    from allhands.trainer import build_reference_model

    cfg = Config.from_dict(cfg_dict)
    env = worker_env()
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, device="cpu",
                      backend="gloo", dp_replicate=-1, timeout_s=300)
    torch.set_num_threads(1)
    train_ds, _, _ = load_token_splits(cfg.data.path, cfg.model.seq_len)
    torch.manual_seed(0)
    raw = build_reference_model(cfg, 257)
    model = DDP(raw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ts = TrainState()
    state = {"model": ModelOptimState(model, opt), "train": ts, "rng": RNGState(mesh.rank)}
    per_rank = cfg.run.global_batch // mesh.world_size
    g = torch.Generator().manual_seed(mesh.rank)

    waited = [0.0]  # seconds in before_update: the part of an async save's copy not overlapped

    def steps(n: int, ckpt: Checkpointer | None = None) -> None:
        for _ in range(n):
            idx = torch.randint(len(train_ds), (per_rank,), generator=g).tolist()
            x = torch.stack([train_ds[i][0] for i in idx])
            y = torch.stack([train_ds[i][1] for i in idx])
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            if ckpt is not None:  # as the trainer does: the copy to host memory ends here at the latest
                w0 = time.perf_counter()
                ckpt.before_update()
                waited[0] += time.perf_counter() - w0
            opt.step()
            opt.zero_grad(set_to_none=True)
            ts.step += 1

    nice = {"async": ckpt_mod.WRITER_NICE, "async0": 0}
    ckpts = {m: Checkpointer(Path(out) / m, rank=mesh.rank, keep_last=1, mode=m[:5],
                             group=mesh.checkpoint_group() if m != "sync" else None)
             for m in ("sync", "async", "async0")}
    steps(3)  # warm-up: optimizer state exists, so every save has the same size
    for c in ckpts.values():  # each Checkpointer's first save also prepares the directory
        c.save(ts.step, state)
        c.wait()
    order = ("base", "async", "async0", "sync")
    res: dict[str, list[float]] = {k: [] for m in order for k in (m, f"stall_{m}", f"cpu_{m}")}
    for r in range(rounds):
        for mode in order[r % 4:] + order[:r % 4]:
            ckpt = ckpts.get(mode)
            ckpt_mod.WRITER_NICE = nice.get(mode, ckpt_mod.WRITER_NICE)  # read by each save's writer
            t0, c0 = time.perf_counter(), time.process_time()  # process CPU: every thread's
            for b in range(blocks):
                w0 = waited[0]
                steps(interval, ckpt)
                if ckpt is not None:
                    if b:  # what of the previous save's copy did not overlap these steps
                        res[f"stall_{mode}"][-1] += waited[0] - w0
                    s0 = time.perf_counter()
                    ckpt.save(ts.step, state)
                    res[f"stall_{mode}"].append(time.perf_counter() - s0)
            if ckpt is not None:
                w0 = time.perf_counter()
                ckpt.before_update()  # the last save's copy belongs to this series' stall
                res[f"stall_{mode}"][-1] += time.perf_counter() - w0
                ckpt.wait()  # and its write to this series' time
            res[mode].append(time.perf_counter() - t0)
            res[f"cpu_{mode}"].append(time.process_time() - c0)
    for c in ckpts.values():
        c.close()
        assert c.failures == 0, c.warnings
    if mesh.rank == 0:
        size = sum(p.stat().st_size for p in next(iter((Path(out) / "async").glob("step-*"))).rglob("*"))
        res["bytes"] = [float(size)]
    Path(out, f"result-{mesh.rank}.json").write_text(json.dumps(res))
    mesh.destroy()


def main() -> None:
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--interval", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=2)
    args = ap.parse_args()

    from allhands.checkpoint import WRITER_NICE
    from allhands.config import load_config
    from allhands.launch import LaunchSpec, launch, resolve_run

    out = tempfile.mkdtemp(prefix="allhands-bench-ckpt-")
    cfg = load_config(overrides=[*MODEL, "run.global_batch=16", f"run.dir={out}/resolve",
                                 "log.progress=false", "log.tensorboard=false"])
    cfg = resolve_run(cfg, resume=None, world_size=2)
    launch(worker, (cfg.to_dict(), args.rounds, args.interval, args.blocks, out), LaunchSpec(nproc=2))
    r = json.loads(Path(out, "result-0.json").read_text())
    r1 = json.loads(Path(out, "result-1.json").read_text())
    cpu = {m: [a + b for a, b in zip(r[f"cpu_{m}"], r1[f"cpu_{m}"])] for m in ("base", "async", "async0", "sync")}
    med = {k: statistics.median(v) for k, v in r.items() if v}
    # Paired per round: a round's series ran back to back, so drift cancels within it.
    over = {m: statistics.median((x - b) / b for x, b in zip(r[m], r["base"])) for m in ("async", "async0", "sync")}
    step = med["base"] / args.interval / args.blocks
    cost = over["async"] * args.interval * step  # seconds one async save adds to training
    print(f"rounds={args.rounds} interval={args.interval} steps ranks=2 model={' '.join(MODEL)} "
          f"global_batch=16 checkpoint={r['bytes'][0] / 2**20:.1f} MiB on disk; writer at nice {WRITER_NICE} (async0: nice 0)")
    for m in ("sync", "async", "async0"):
        print(f"stall per save (s): {m} " + " ".join(f"{v:.4f}" for v in r[f"stall_{m}"]))
    print(f"series of {args.blocks} x ({args.interval} steps + save) (s): "
          + " | ".join(f"{m} " + " ".join(f"{v:.2f}" for v in r[m]) for m in ("base", "async", "async0", "sync")))
    print(f"median stall per save: sync {med['stall_sync']:.3f} s, async {med['stall_async']:.4f} s; "
          f"ratio sync/async = {med['stall_sync'] / med['stall_async']:.1f}x (target >= 10)")
    print(f"step time {step:.3f} s; overhead of a save every {args.interval} steps (median of per-round "
          f"ratios): async {100 * over['async']:+.1f}% (target <= 2%), async0 {100 * over['async0']:+.1f}%, "
          f"sync {100 * over['sync']:+.1f}%")
    # CPU seconds of both ranks' processes (every thread): what checkpointing costs in work,
    # which other jobs on the machine do not inflate the way they inflate wall time.
    cpu_over = {m: statistics.median((x - b) / b for x, b in zip(cpu[m], cpu["base"])) for m in ("async", "sync")}
    print("CPU time per series, both ranks (s): " + " | ".join(
        f"{m} " + " ".join(f"{v:.2f}" for v in cpu[m]) for m in ("base", "async", "async0", "sync")))
    print(f"CPU cost of a save every {args.interval} steps (median of per-round ratios): async "
          f"{100 * cpu_over['async']:+.1f}%, sync {100 * cpu_over['sync']:+.1f}% of the training CPU; one async "
          f"save = {statistics.median(cpu['async']) / args.blocks - statistics.median(cpu['base']) / args.blocks:.3f} "
          f"CPU s")
    pick = max(1, math.ceil(cost / (0.02 * step))) if cost > 0 else 1
    print(f"one async save adds {cost:.3f} s = {cost / step:.2f} steps; checkpoint.max_overhead=0.02 "
          f"with checkpoint.interval=1 would save every {pick} steps")


if __name__ == "__main__":
    main()
