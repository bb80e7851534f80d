"""The timing probes behind calibrate.py, run in ``nproc`` gloo processes on loopback: the
alpha-beta figures of each collective, what DDP, FSDP2 and sequence-parallel TP add to a forward +
backward over the same plain modules, the update's extra cost per DTensor, Partial-gradient and
ZeRO-1 parameter and 1F1B's cost per microbatch. Each figure is the fastest of its repetitions (calibrate.py says why)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

SIZES = (64, 2 ** 18)  # float32 elements: latency-bound and bandwidth-bound payloads
REPS = 40


def _best_time(fn, reps: int = REPS) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _alpha_beta(t_small: float, t_large: float, b_small: float, b_large: float) -> list[float]:
    beta = max(0.0, (t_large - t_small) / (b_large - b_small))
    return [max(0.0, t_small - beta * b_small), beta]


SPANS = (2, 6)  # halves in the framework-cost probes: the slope is per unit, the rest per step


class _Half(torch.nn.Module):
    """Half a transformer block (norm, MLP, residual): the unit the framework probes wrap."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.ln, self.fc, self.proj = torch.nn.LayerNorm(c), torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


def _extra(wrapped, n: int, x: torch.Tensor, barrier, *, full: torch.Tensor | None = None,
           reps: int = 40) -> float:
    """Extra seconds of a forward + backward of ``wrapped`` (DDP, FSDP2 or TP around ``n``
    halves) over ``n`` plain halves: the fastest of each, timed alternately."""
    plain = torch.nn.Sequential(*[_Half() for _ in range(n)])
    full = x if full is None else full
    barrier()
    ours, theirs = [], []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        wrapped(x).sum().backward()
        t1 = time.perf_counter()
        plain(full).sum().backward()
        if i >= 5:
            ours.append(t1 - t0)
            theirs.append(time.perf_counter() - t1)
    return max(0.0, min(ours) - min(theirs))


def _fit(wrap, x: torch.Tensor, barrier, **kw) -> tuple[float, float]:
    """(seconds per step, seconds per half) of what ``wrap(nn.Sequential of halves)`` adds,
    from SPANS: a framework's cost has a per-step part (root hooks, final callbacks) and a
    per-module part."""
    (n0, n1) = SPANS
    c0, c1 = (_extra(wrap(torch.nn.Sequential(*[_Half() for _ in range(n)])), n, x, barrier, **kw)
              for n in SPANS)
    per = max(0.0, (c1 - c0) / (n1 - n0))
    return max(0.0, c0 - n0 * per), per


def probe_worker(rank: int, world: int, store_path: str, out_path: str) -> None:
    """One rank of the probe (spawned): times each collective and the DTensor/FSDP costs."""
    import torch.distributed as dist  # start-up time: only the probe needs process groups
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from allhands.sync.allreduce import _bucket_bytes, _metered
    from allhands.sync.comm import CommMeter

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        out: dict = {}
        peer = 1 - rank  # send/recv between ranks 0 and 1 only
        for name in ("allreduce", "allgather", "reducescatter", "broadcast", "sendrecv"):
            points = []
            for n in SIZES:
                x, full, part, rbuf = torch.ones(n), torch.empty(world * n), torch.empty(n // world), torch.empty(n)
                op = {"allreduce": lambda: dist.all_reduce(x),
                      "allgather": lambda: dist.all_gather_into_tensor(full, x),
                      "reducescatter": lambda: dist.reduce_scatter_tensor(part, x),
                      "broadcast": lambda: dist.broadcast(x, 0),
                      # a ping-pong, halved below: one hop, the receiver woken (Hockney)
                      "sendrecv": lambda: (dist.send(x, peer), dist.recv(rbuf, peer)) if rank == 0
                      else (dist.recv(rbuf, peer), dist.send(x, peer)) if rank == 1 else None}[name]
                dist.barrier()
                points.append(_best_time(op) / (2 if name == "sendrecv" else 1))
            out[name] = _alpha_beta(points[0], points[1], 4.0 * SIZES[0], 4.0 * SIZES[1])
        mesh = init_device_mesh("cpu", (world,))
        x = torch.ones(8, 16, 16)
        for zero, reshard in ((2, False), (3, True)):  # FSDP2: one unit per block and the root
            def shard(seq: nn.Sequential, reshard: bool = reshard) -> nn.Sequential:
                for layer in seq:
                    fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
                return fully_shard(seq, mesh=mesh, reshard_after_forward=reshard)

            out[f"fsdp_step_zero{zero}"], out[f"fsdp_unit_zero{zero}"] = _fit(shard, x, dist.barrier)
        sharded = shard(nn.Sequential(*[_Half() for _ in range(SPANS[0])]))
        # clipping + AdamW + zero_grad over DTensor parameters (FSDP shards, TP) costs more per
        # tensor than over plain ones: DTensor dispatch of every op, the norm's all-reduce
        plain = nn.Sequential(*[_Half() for _ in range(SPANS[0])])
        params = [list(plain.parameters()), list(sharded.parameters())]
        optims = [torch.optim.AdamW(p) for p in params]

        def update(i: int) -> float:  # seconds of one update of the parameters params[i]
            for q in params[i]:
                q.grad = DTensor.from_local(torch.ones_like(q.to_local()), mesh, [Partial()], run_check=False) \
                    if i == 3 else torch.ones_like(q)
            t0 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(params[i], 1.0)
            optims[i].step()
            optims[i].zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        dist.barrier()
        # ZeRO-1 (parallel/zero1.py): the owner's AdamW, then every parameter broadcast from its
        # owner, one call each; its cost beyond plain AdamW over the same tensors, per tensor
        zeroed = nn.Sequential(*[_Half() for _ in range(SPANS[0])])
        params.append(list(zeroed.parameters()))
        optims.append(ZeroRedundancyOptimizer(params[2], optimizer_class=torch.optim.AdamW,
                                              parameters_as_bucket_view=False))
        # Sequence-parallel TP leaves the gradients of replicated parameters (its norms) Partial:
        # DTensor all-reduces such a gradient again in every op that reads it (the norm, then
        # AdamW's lerp_ and addcmul_(grad, grad)), torch/distributed/tensor/_dispatch.py
        params.append([nn.Parameter(DTensor.from_local(q.detach(), mesh, [Replicate()], run_check=False))
                       for q in nn.Sequential(*[_Half() for _ in range(SPANS[0])]).parameters()])
        optims.append(torch.optim.AdamW(params[3]))
        rounds = [(update(1), update(2), update(0), update(3)) for _ in range(30)][5:]
        best = [min(t[i] for t in rounds) for i in range(4)]
        out["dtensor_update_tensor"] = max(0.0, best[0] - best[2]) / len(params[1])
        out["zero1_update_tensor"] = max(0.0, best[1] - best[2]) / len(params[2])
        out["partial_grad_tensor"] = max(0.0, best[3] - best[2]) / len(params[3])
        out.update(_pipeline_probe(rank, x))
        def ddp(seq: nn.Sequential) -> DistributedDataParallel:
            # with the allreduce strategy's metered Python comm hook, as sync/allreduce.py wraps
            # DDP (a Python hook costs more than DDP's built-in C++ all-reduce)
            model = DistributedDataParallel(seq)
            model.register_comm_hook(None, _metered(default_hooks.allreduce_hook, CommMeter(), world,
                                                    _bucket_bytes(None)))
            return model

        out["ddp_step"], out["ddp_half"] = _fit(ddp, x, dist.barrier)

        def tp(seq: nn.Sequential) -> nn.Sequential:  # sequence parallel, as parallel/tensor.py
            for half in seq:
                parallelize_module(half, mesh, {"ln": SequenceParallel(),
                                                "fc": ColwiseParallel(input_layouts=Shard(1)),
                                                "proj": RowwiseParallel(output_layouts=Shard(1))})
            return seq

        # per parallelized module (a half: a SequenceParallel norm, a column- and a row-wise linear)
        out["tp_step"], per_half = _fit(tp, x[:, : 16 // world], dist.barrier, full=x)
        out["tp_module"] = per_half / 3
        if rank == 0:
            Path(out_path).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _pipeline_probe(rank: int, x: torch.Tensor) -> dict:
    """1F1B over ranks 0 and 1, two halves a stage, 2 and 6 microbatches of ``len(x)`` samples:
    the slope per microbatch beyond its plain compute is the schedule's own cost (P2P, stage
    bookkeeping); the rest waits in ``dist.barrier`` (every rank creates the group)."""
    import torch.distributed as dist  # start-up time, as in _probe_worker
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    group = dist.new_group([0, 1])
    if rank >= 2:
        dist.barrier()
        return {}
    plain = torch.nn.Sequential(_Half(), _Half())
    runs = {}
    for m in (2, 6):  # a stage each: a stage keeps buffers for its schedule's microbatch count
        stage = PipelineStage(torch.nn.Sequential(_Half(), _Half()), rank, 2, torch.device("cpu"), group=group)
        sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, target: out.sum())
        batch, target = torch.cat([x] * m), torch.zeros(len(x) * m)
        runs[m] = lambda sched=sched, batch=batch, target=target: (
            sched.step(batch) if rank == 0 else sched.step(target=target))
    best = {2: float("inf"), 6: float("inf"), "plain": float("inf")}
    for i in range(25):  # the three timed alternately, the fastest of each kept
        for key, fn in ((2, runs[2]), (6, runs[6]), ("plain", lambda: plain(x).sum().backward())):
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                best[key] = min(best[key], time.perf_counter() - t0)
    dist.barrier()
    # 1F1B takes (m + p - 1) stage-microbatch times: the slope in m is one
    return {"pp_microbatch": max(0.0, (best[6] - best[2]) / 4 - best["plain"])}
