"""What sharding costs and saves, per layout, measured side by side in the same worker processes.

For each world size (2 and 4 ranks) one job builds every layout on the same model (plain DDP,
ZeRO-1, ZeRO-2, ZeRO-3, and on 4 ranks hybrid 2x2 ZeRO-3), then alternates them round by round:

- memory: per-rank training-state bytes (parameters + gradients + optimizer state, counted from
  the local shards after a step, before zero_grad) / the ZeRO formula of allhands.memory
  (fp32 + AdamW: DDP 16 Psi, ZeRO-1 8 Psi + 8 Psi/N, ZeRO-2 4 Psi + 12 Psi/N, ZeRO-3 16 Psi/N);
  for ZeRO-2/3 also "in step", where the full parameters FSDP holds at the end of forward are
  added (that is where the paper's stage-2 term 4 Psi lives);
- communication: bytes each rank sends per step, from the collectives themselves: FSDP's and
  ZeRO-1's c10d ops seen by a TorchDispatchMode, DDP's all-reduce through a DDP comm hook that
  counts each bucket. Ring cost per rank: all-reduce of B bytes sends 2(N-1)/N B, all-gather
  into B and reduce-scatter of B send (N-1)/N B each. Paper: ZeRO-3 / DDP = 1.5;
- step time: median over rounds of each round's median step, / DDP's.

    python bench/sharding.py [--rounds 3] [--steps 8]
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

MODEL = dict(vocab_size=257, seq_len=64, n_layer=4, n_head=4, n_embd=128, bias=False)
GLOBAL_BATCH = 16


def layouts(world: int) -> dict[str, dict]:
    out = {"ddp": dict(dp_replicate=world, dp_shard=1, zero=0),
           "zero1": dict(dp_replicate=1, dp_shard=world, zero=1),
           "zero2": dict(dp_replicate=1, dp_shard=world, zero=2),
           "zero3": dict(dp_replicate=1, dp_shard=world, zero=3)}
    if world == 4:
        out["hybrid2x2-zero3"] = dict(dp_replicate=2, dp_shard=2, zero=3)
    return out


def worker(rounds: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils._python_dispatch import TorchDispatchMode

    from allhands.config import Config
    from allhands.env import worker_env
    from allhands.memory import expected_bytes, state_bytes
    from allhands.mesh import Mesh
    from allhands.models import GPT, GPTConfig
    from allhands.parallel import apply_zero1, clip_grad_norm, parallelize
    from allhands.optim import build_optimizer

    env = worker_env()
    world = env.world_size
    torch.set_num_threads(1)
    cfg = Config()
    sent = {"bytes": 0.0, "paused": False}

    def ring_bytes(kind: str, nbytes: int, n: int) -> float:
        return (2 if kind == "allreduce" else 1) * (n - 1) / n * nbytes

    class CountCollectives(TorchDispatchMode):
        """Bytes this rank sends in the c10d ops it issues (FSDP2, ZeroRedundancyOptimizer)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__ if hasattr(func, "__name__") else str(func)
            if func.namespace == "c10d" and not sent["paused"]:
                group_size = world_of(args)
                if "allgather_base" in name:        # (output, input, group, ...)
                    sent["bytes"] += ring_bytes("allgather", nbytes(args[0]), group_size)
                elif "reduce_scatter_base" in name:  # (output, input, group, ...)
                    sent["bytes"] += ring_bytes("reducescatter", nbytes(args[1]), group_size)
                elif "allreduce" in name:
                    sent["bytes"] += ring_bytes("allreduce", sum(map(nbytes, args[0])), group_size)
                elif "broadcast" in name:            # ZeRO-1's parameter broadcast: root sends all
                    sent["bytes"] += sum(map(nbytes, args[0])) / group_size
            return func(*args, **(kwargs or {}))

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    def world_of(args) -> int:
        for a in args:  # the c10d op carries its ProcessGroup as a boxed ScriptObject
            if isinstance(a, torch.ScriptObject):
                return dist.ProcessGroup.unbox(a).size()
        raise RuntimeError("c10d op without a process group")

    def counting_allreduce(state, bucket):
        # Counted here, so the dispatch mode must not count the all_reduce this issues again.
        n = dist.get_world_size(state)
        sent["bytes"] += ring_bytes("allreduce", nbytes(bucket.buffer()), n)
        sent["paused"] = True
        try:
            return default_hooks.allreduce_hook(state, bucket)
        finally:
            sent["paused"] = False

    gen = torch.Generator().manual_seed(0)
    batch = GLOBAL_BATCH // world
    data = [torch.randint(0, MODEL["vocab_size"], (batch, MODEL["seq_len"] + 1), generator=gen)
            for _ in range(4)]
    runs = {}
    for name, lay in layouts(world).items():
        mesh = Mesh.build(rank=env.rank, world_size=world, local_rank=env.local_rank, device="cpu",
                          backend="gloo", dp_replicate=lay["dp_replicate"], dp_shard=lay["dp_shard"],
                          timeout_s=300)
        torch.manual_seed(0)
        model = parallelize(GPT(GPTConfig(**MODEL)), mesh, zero=lay["zero"])
        if isinstance(model, DDP):
            model.register_comm_hook(mesh.dp_group, counting_allreduce)
        opt = build_optimizer(model.module if isinstance(model, DDP) else model, cfg)
        if lay["zero"] == 1:
            opt = apply_zero1(opt, mesh)
        runs[name] = dict(mesh=mesh, model=model, opt=opt, zero=lay["zero"], times=[], comm=None,
                          mem=None, in_step=0)

    def raw(model):
        return model.module if isinstance(model, DDP) else model

    def step(r: dict, i: int, measure: bool = False) -> None:
        model, opt = r["model"], r["opt"]
        x = data[i % len(data)]
        full_at_forward_end = []
        hook = None
        if measure and r["zero"] >= 2:
            # Full (non-DTensor) parameters registered at the end of forward: what FSDP holds
            # unsharded between forward and backward.
            hook = model.register_forward_hook(lambda m, a, o: full_at_forward_end.append(
                sum(nbytes(p) for p in m.parameters() if not isinstance(p, DTensor))))
        logits = model(x[:, :-1])
        if hook is not None:
            hook.remove()
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        clip_grad_norm(raw(model).parameters(), 1.0)
        opt.step()
        if measure:
            r["mem"] = state_bytes(raw(model), opt)
            r["in_step"] = full_at_forward_end[0] if full_at_forward_end else 0
        opt.zero_grad(set_to_none=True)

    for name, r in runs.items():  # warm-up step; measures memory and one step's traffic
        sent["bytes"] = 0.0
        with CountCollectives():
            step(r, 0, measure=True)
        r["comm"] = sent["bytes"]
    for _ in range(rounds):
        for name, r in runs.items():
            times = []
            for i in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(r, i)
                times.append(time.perf_counter() - t0)
            # the slowest rank decides a synchronous step
            t = torch.tensor([statistics.median(times)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            r["times"].append(float(t))
    rows = {}
    for name, r in runs.items():
        mem = r["mem"]
        held = mem["params"] + mem["grads"] + mem["optim"]
        n = r["mesh"].size("dp_shard")
        rows[name] = dict(zero=r["zero"], held=held, in_step=held + r["in_step"], numel=mem["numel"],
                          expected=expected_bytes(mem["numel"], r["zero"], n), comm=r["comm"],
                          times=r["times"], n_shard=n)
    # Each rank's rows through the shared filesystem as JSON: no peer data is unpickled
    # (all_gather_object would), the project's rule for shipped code kept in the bench too.
    Path(f"{out}.rank{env.rank}").write_text(json.dumps(rows))
    dist.barrier()
    if env.rank == 0:
        gathered = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
        Path(out).write_text(json.dumps({"world": world, "ranks": gathered}))
    dist.destroy_process_group()


def report(result: dict) -> None:
    world, ranks = result["world"], result["ranks"]
    base = ranks[0]["ddp"]
    ddp_time = statistics.median(base["times"])
    print(f"\n{world} ranks, Psi = {base['numel']:,} parameters, global batch {GLOBAL_BATCH}")
    print(f"{'layout':17} {'state/rank MiB':>15} {'formula MiB':>12} {'ratio':>6} "
          f"{'in-step ratio':>13} {'sent/step MiB':>14} {'comm / DDP':>10} {'step s':>7} {'time / DDP':>10}")
    for name in ranks[0]:
        held = max(r[name]["held"] for r in ranks)      # the fullest rank
        in_step = max(r[name]["in_step"] for r in ranks)
        row = ranks[0][name]
        comm = statistics.mean(r[name]["comm"] for r in ranks)
        ddp_comm = statistics.mean(r["ddp"]["comm"] for r in ranks)
        t = statistics.median(row["times"])
        in_step_txt = f"{in_step / row['expected']:.3f}" if row["zero"] >= 2 else "-"
        print(f"{name:17} {held / 2**20:15.3f} {row['expected'] / 2**20:12.3f} "
              f"{held / row['expected']:6.3f} {in_step_txt:>13} {comm / 2**20:14.3f} "
              f"{comm / ddp_comm:10.3f} {t:7.4f} {t / ddp_time:10.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--worlds", default="2,4")
    args = ap.parse_args()

    from allhands.launch.launcher import LaunchSpec, launch

    tmp = Path(tempfile.mkdtemp(prefix="allhands-bench-sharding-"))
    print(f"model {MODEL}, rounds={args.rounds} steps/round={args.steps}, 1 thread per rank")
    for world in (int(w) for w in args.worlds.split(",")):
        out = tmp / f"w{world}.json"
        launch(worker, (args.rounds, args.steps, str(out)), LaunchSpec(nproc=world), threads=1)
        report(json.loads(out.read_text()))


if __name__ == "__main__":
    main()
