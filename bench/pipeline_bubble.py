"""Pipeline bubble and the step-time cost of tensor/pipeline layouts, on 2 gloo ranks.

1. Bubble. The reference GPT cut into p=2 stages (``allhands.parallel.pipeline``), the 1F1B and
   GPipe schedules over m = 2, 4, 8 microbatches of a fixed size. Each stage's busy time is the
   time spent inside its ``forward_one_chunk`` / ``backward_one_chunk`` calls (compute only; the
   schedule waits for activations and gradients outside them); idle = step wall time - busy,
   where a step runs from a barrier of both stages to the next one after the schedule returns.
   The bubble formula (GPipe paper, Huang et al. 2019; Narayanan et al. 2021 for 1F1B) says the
   idle time is (p-1)/m of the ideal (busy) time, so the figure per stage is
   ``(idle / busy) / ((p-1)/m)``, idle/busy taken per step and its median over the steps: 1.0 means the bubble is exactly what theory predicts; more
   means extra idle time (p2p transfers, unequal stages: the first stage holds the embedding,
   the last the head and the loss).

2. Step time of tp=2 and pp=2 (1F1B, m=4) relative to plain DDP (dp=2) on the same model, same
   global batch, same 2 processes: the three layouts alternate in rounds inside the same
   workers (a mesh per layout), so machine noise hits all alike; median step time per round.

3. Every schedule (``--schedules``): torch's seven schedules at p=2 and p=4 (2 and 4 processes),
   m=8 microbatches, a GPT of 8 blocks; busy time also counts the zero-bubble schedules'
   ``backward_weight_one_chunk``. Printed per schedule: the idle fraction idle/busy (mean over
   ranks of the per-step median) beside its published bubble, in units where a forward, an
   input-gradient backward and a weight-gradient backward cost the same (F = B = W, full backward
   2): GPipe/1F1B (p-1)/m; Interleaved 1F1B and looped BFS (p-1)/(v m) (Narayanan et al. 2021,
   Lamy-Poirier 2023); ZB1P (p-1)(F+B-2W)/(m(F+B)) = (p-1)/(3m) (Qi et al. 2024); ZB-V 0
   (Qi et al. 2024, section 6); DualPipeV (p/2-1)(F&B+B-3W)/(m(F+B)) = (p-2)/(3m) (DeepSeek-V3,
   table 2, with an overlapped F&B costing F+B).

    python bench/pipeline_bubble.py [--rounds 3] [--steps 12]
    python bench/pipeline_bubble.py --schedules [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import TIMING_ONLY  # noqa: E402  (bench/ is sys.path[0])

MODEL = dict(n_layer=4, n_head=4, n_embd=192, seq_len=128)
MICRO = 4  # samples per pipeline microbatch in the bubble part
LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2"],
    "tp2": ["parallel.dp_replicate=1", "parallel.tp=2"],
    "pp2": ["parallel.dp_replicate=1", "parallel.pp=2", "parallel.pp_microbatches=4"],
}


def timed(fn, busy: list[float]):
    """``fn`` adding the seconds spent inside it to ``busy[0]``."""
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            busy[0] += time.perf_counter() - t
    return wrapper


def bubble(mesh, steps: int) -> dict:
    """Per (schedule, m): each stage's busy seconds and the wall seconds of the timed steps."""
    import copy

    import torch
    import torch.nn.functional as F

    from allhands.models import GPT, GPTConfig
    from allhands.parallel.pipeline import build_pipeline

    out = {}
    torch.manual_seed(0)
    full = GPT(GPTConfig(vocab_size=257, **MODEL))
    pp_mesh = mesh.device_mesh["pp"]
    for schedule in ("1f1b", "gpipe"):
        for m in (2, 4, 8):
            pipe = build_pipeline(copy.deepcopy(full), pp_rank=pp_mesh.get_local_rank(), pp_size=2,
                                  group=pp_mesh.get_group(), schedule=schedule, n_microbatches=m)
            pipe.start(mesh.device, lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()))
            stage = pipe.schedule._stage
            busy = [0.0]

            stage.forward_one_chunk = timed(stage.forward_one_chunk, busy)
            stage.backward_one_chunk = timed(stage.backward_one_chunk, busy)
            g = torch.Generator().manual_seed(1)
            x = torch.randint(0, 257, (m * MICRO, MODEL["seq_len"]), generator=g)
            walls, busies = [], []
            for i in range(steps + 2):  # two warm-up steps (shape inference, allocator)
                torch.distributed.barrier(group=pp_mesh.get_group())
                busy[0] = 0.0
                t0 = time.perf_counter()
                pipe.step(x, x)
                # the step ends when the last stage is done: without this the last stage's
                # clock would stop before the first stage's final backward, hiding that bubble
                torch.distributed.barrier(group=pp_mesh.get_group())
                if i >= 2:
                    walls.append(time.perf_counter() - t0)
                    busies.append(busy[0])
                for mod in pipe.modules:
                    mod.zero_grad(set_to_none=True)
            # per step, median over steps: one step slowed by another process on this shared
            # machine must not decide the figure
            out[f"{schedule}/{m}"] = statistics.median((w - b) / b for w, b in zip(walls, busies))
    return out


SCHED_MODEL = dict(n_layer=8, n_head=2, n_embd=96, seq_len=64)
SCHED_M, SCHED_MICRO = 8, 2


def published_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """idle / busy by the schedule's paper, F = B = W (see the module doc)."""
    return {"gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "interleaved1f1b": (p - 1) / (v * m),
            "loopedbfs": (p - 1) / (v * m), "interleavedzerobubble": (p - 1) / (3 * m),
            "zbvzerobubble": 0.0, "dualpipev": (p - 2) / (3 * m)}[schedule]


def schedule_bubbles(mesh, steps: int) -> dict:
    """Per schedule: this rank's median idle/busy over the timed steps."""
    import copy

    import torch
    import torch.nn.functional as F

    from allhands.config import PP_SCHEDULES
    from allhands.config.pipeline import SINGLE_STAGE
    from allhands.models import GPT, GPTConfig
    from allhands.parallel.pipeline import build_pipeline

    torch.manual_seed(0)
    full = GPT(GPTConfig(vocab_size=257, **SCHED_MODEL))
    pp_mesh, p = mesh.device_mesh["pp"], mesh.size("pp")
    out = {}
    for schedule in PP_SCHEDULES:
        v = 1 if schedule in SINGLE_STAGE else 2
        pipe = build_pipeline(copy.deepcopy(full), pp_rank=pp_mesh.get_local_rank(), pp_size=p,
                              group=pp_mesh.get_group(), schedule=schedule, n_microbatches=SCHED_M,
                              stages_per_rank=v, tied_group=mesh.pp_ends_group() if p > 2 else None)
        pipe.start(mesh.device, lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()))
        busy = [0.0]

        for stage in getattr(pipe.schedule, "_stages", None) or [pipe.schedule._stage]:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, timed(getattr(stage, name), busy))
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 257, (SCHED_M * SCHED_MICRO, SCHED_MODEL["seq_len"]), generator=g)
        ratios = []
        for i in range(steps + 2):  # two warm-up steps
            torch.distributed.barrier(group=pp_mesh.get_group())
            busy[0] = 0.0
            t0 = time.perf_counter()
            pipe.step(x, x)
            pipe.sync_tied_grads()
            torch.distributed.barrier(group=pp_mesh.get_group())
            if i >= 2:
                ratios.append((time.perf_counter() - t0 - busy[0]) / busy[0])
            for mod in pipe.modules:
                mod.zero_grad(set_to_none=True)
        out[schedule] = statistics.median(ratios)
    return out


def schedules_worker(steps: int, out: str) -> None:
    import torch

    from allhands.env import worker_env
    from allhands.mesh import Mesh

    torch.set_num_threads(1)
    env = worker_env()
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, device="cpu",
                      backend="gloo", dp_replicate=1, pp=env.world_size, timeout_s=300)
    Path(out, f"sched.p{env.world_size}.rank{env.rank}.json").write_text(
        json.dumps(schedule_bubbles(mesh, steps)))
    mesh.destroy()


def main_schedules(steps: int) -> None:
    from allhands.launch.launcher import LaunchSpec, launch

    out = tempfile.mkdtemp(prefix="allhands-bench-schedules-")
    print(f"m={SCHED_M} microbatches of {SCHED_MICRO} x seq {SCHED_MODEL['seq_len']}, GPT "
          + " ".join(f"{k}={v}" for k, v in SCHED_MODEL.items()) + f", {steps} timed steps; "
          "idle/busy measured (mean over ranks) vs published, and 1F1B's published")
    for p in (2, 4):
        launch(schedules_worker, (steps, out), LaunchSpec(nproc=p), threads=1)
        ranks = [json.loads(Path(out, f"sched.p{p}.rank{r}.json").read_text()) for r in range(p)]
        for schedule in ranks[0]:
            v = 1 if schedule in ("gpipe", "1f1b") else 2
            got = statistics.mean(r[schedule] for r in ranks)
            print(f"p={p} {schedule:22s} measured {got:.3f}  published {published_bubble(schedule, p, SCHED_M, v):.3f}"
                  f"  1f1b published {published_bubble('1f1b', p, SCHED_M, 1):.3f}")


def layout_steps(cfg_dict: dict, extra: list[str], run_dir: Path, env) -> list[float]:
    from allhands.config import Config, apply_override
    from allhands.mesh import Mesh
    from allhands.trainer import Job, Trainer

    cfg = Config.from_dict(cfg_dict)
    for item in extra:
        apply_override(cfg, item)
    cfg.run.dir = str(run_dir)
    p = cfg.parallel
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                      device="cpu", backend="gloo", dp_replicate=p.dp_replicate, dp_shard=p.dp_shard,
                      tp=p.tp, pp=p.pp, timeout_s=120)
    Trainer(cfg, Job(), mesh, run_dir).fit()
    if mesh.rank != 0:
        return []
    stamps = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return [b - a for a, b in zip(stamps, stamps[1:])]


def worker(cfg_dict: dict, rounds: int, steps: int, out: str) -> None:
    import torch

    from allhands.env import worker_env
    from allhands.mesh import Mesh

    torch.set_num_threads(1)
    env = worker_env()
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, device="cpu",
                      backend="gloo", dp_replicate=1, pp=2, timeout_s=120)
    result = {"bubble": bubble(mesh, steps), "layouts": {k: [] for k in LAYOUTS}}
    # Each rank's figures through the shared filesystem as JSON (no unpickling of peer data).
    Path(out, f"bubble.rank{env.rank}.json").write_text(json.dumps(result["bubble"]))
    torch.distributed.barrier()
    result["bubble"] = [json.loads(Path(out, f"bubble.rank{r}.json").read_text())
                        for r in range(env.world_size)]
    for r in range(rounds):
        for name, extra in LAYOUTS.items():
            run_dir = Path(out, f"{name}-{r}")
            run_dir.mkdir(exist_ok=True)
            times = layout_steps(cfg_dict, extra, run_dir, env)
            if env.rank == 0:
                result["layouts"][name].append(statistics.median(times[2:] or times))
    if env.rank == 0:
        Path(out, "result.json").write_text(json.dumps(result))
    mesh.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--schedules", action="store_true", help="every torch schedule at p=2 and p=4")
    args = ap.parse_args()
    if args.schedules:
        main_schedules(args.steps)
        return

    from allhands.config import load_config
    from allhands.launch.launcher import LaunchSpec, launch
    from allhands.launch.rundir import resolve_run

    out = tempfile.mkdtemp(prefix="allhands-bench-pipeline-")
    model = [f"model.{k}={v}" for k, v in MODEL.items()]
    cfg = load_config(overrides=[*model, f"run.steps={args.steps}", "run.global_batch=16",
                                 *TIMING_ONLY, f"run.dir={out}/resolve", "run.threads=1"])
    cfg = resolve_run(cfg, resume=None, world_size=2)
    launch(worker, (cfg.to_dict(), args.rounds, args.steps, out), LaunchSpec(nproc=2), threads=1)
    res = json.loads(Path(out, "result.json").read_text())
    p = 2
    print(f"p={p} stages, {MICRO} samples x seq {MODEL['seq_len']} per microbatch, model "
          + " ".join(f"{k}={v}" for k, v in MODEL.items()) + f", {args.steps} timed steps")
    print("schedule  m  (p-1)/m  stage: idle/busy  ratio to (p-1)/m")
    for key in res["bubble"][0]:
        schedule, m = key.split("/")
        theory = (p - 1) / int(m)
        cells = []
        for stage, per_rank in enumerate(res["bubble"]):
            idle = per_rank[key]
            cells.append(f"s{stage}: {idle:.3f} -> {idle / theory:.2f}")
        print(f"{schedule:8s} {m:>2s}  {theory:.3f}   " + "   ".join(cells))
    lay = {k: statistics.median(v) for k, v in res["layouts"].items()}
    print(f"rounds={args.rounds} global_batch=16, median step (s) per round: "
          + "; ".join(f"{k} " + " ".join(f"{v:.3f}" for v in res['layouts'][k]) for k in lay))
    print(f"step-time ratio tp2/ddp = {lay['tp2'] / lay['ddp']:.2f}, pp2/ddp = {lay['pp2'] / lay['ddp']:.2f}")


if __name__ == "__main__":
    main()
