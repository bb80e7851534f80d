"""Heal: a replica group that joins a quorum takes the model, optimizer, schedule and step of the
quorum's most advanced member, sent as tensors by a broadcast over the quorum's process group
(the layout travels as JSON, never as a pickle); and the glue that runs the quorum
(sync/quorum.py) at each step boundary of the one training loop.

After a heal every member holds bit-identical parameters and optimizer state, and from then on
they apply the same summed gradient, so they stay identical. The data cursor is the step
(data/sampler.py), so it travels as one number.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from allhands.sync.quorum import Quorum, ReplicaQuorum


def group_dir(run_dir: Path, group: int) -> Path:
    """Where replica group ``group`` keeps its metrics and checkpoints: group 0 the run
    directory itself (so reports and resume read it as in restart mode), the others beside it."""
    return run_dir if group == 0 else run_dir / "replicas" / f"group-{group}"


def _bcast(pg: dist.ProcessGroup, tensors: list[torch.Tensor], src: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    for t in tensors:
        pg.broadcast([t], opts).wait()


def _layout(trainer: Any) -> dict[str, Any]:
    """What a receiver must know to allocate and place the tensors that follow (JSON only)."""
    opt = trainer.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    state = []
    for p in params:
        entry = {}
        for k, v in opt.state.get(p, {}).items():
            entry[k] = (["t", list(v.shape), str(v.dtype).removeprefix("torch.")] if torch.is_tensor(v)
                        else ["v", v])
        state.append(entry)
    ts = trainer.train_state
    sched = {k: v for k, v in trainer.scheduler.state_dict().items() if k != "lr_lambdas"}
    return {"train": {k: int(v) for k, v in ts.state_dict().items()}, "scheduler": sched, "state": state,
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def heal(trainer: Any, pg: dist.ProcessGroup, src: int, me: int) -> None:
    """Collective over ``pg``: every member ends with member ``src``'s training state."""
    header = torch.tensor([0], dtype=torch.int64)
    raw = json.dumps(_layout(trainer)).encode() if me == src else b""
    header[0] = len(raw)
    _bcast(pg, [header], src)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if me == src else \
        torch.empty(int(header[0]), dtype=torch.uint8)
    _bcast(pg, [buf], src)
    layout = json.loads(bytes(buf.numpy()).decode())
    opt = trainer.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    tensors = [p.data for p in params]
    for p, entry in zip(params, layout["state"]):
        held = opt.state[p]  # a defaultdict: a fresh process has no state yet
        for k, (kind, *rest) in entry.items():
            if kind == "v":
                held[k] = rest[0]
                continue
            shape, dtype = rest[0], getattr(torch, rest[1])
            if not (torch.is_tensor(held.get(k)) and list(held[k].shape) == shape and held[k].dtype == dtype):
                held[k] = torch.zeros(shape, dtype=dtype, device=p.device)
            tensors.append(held[k])
    _bcast(pg, tensors, src)
    for group, hyper in zip(opt.param_groups, layout["groups"]):
        for k, v in hyper.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    trainer.scheduler.load_state_dict({**trainer.scheduler.state_dict(), **layout["scheduler"]})
    trainer.train_state.load_state_dict(layout["train"])  # its own contract: every field travels


class ReplicaGroup:
    """Replica mode inside one group's worker: the trainer's sampler (this group's shares of each
    global batch under the current quorum), the quorum at each step boundary, and the reduce."""

    def __init__(self, quorum: ReplicaQuorum, trainer: Any):
        self.q, self.n = quorum, quorum.n
        self.sampler = trainer.sampler
        trainer.sampler = self  # the loop asks this object for its micro-batches
        trainer.replica = self
        self.healed_at: list[dict[str, Any]] = []

    def local_micro_batches(self, step: int, rank: int, world: int, micro_batches: int) -> list[list[int]]:
        """This group's shares of step ``step``: ``rank``/``world`` are its own world's (0/1)."""
        q = self.q.quorum
        assert q is not None, "the quorum is formed at the top of each step"
        return [mb for s in q.slots(self.q.group, self.n)
                for mb in self.sampler.local_micro_batches(step, s, self.n, micro_batches)]

    def begin_step(self, trainer: Any) -> bool:
        """At a step boundary: form a new quorum when one is due (a failure, a joiner, the
        start) and take its source's state. True when the state was replaced."""
        if not self.q.reform:
            return False
        t0 = time.perf_counter()
        step = trainer.train_state.step
        q: Quorum = self.q.form(step, on_wait=lambda: trainer.heartbeat.beat(step + 1))
        src, me = q.source, q.members.index(self.q.group)
        before = trainer.train_state.step
        heal(trainer, self.q.pg, src, me)
        took = time.perf_counter() - t0
        event = {"time": time.time(), "pid": os.getpid(), "quorum": q.qid, "members": list(q.members),
                 "from_group": q.members[src], "was_at": before, "step": trainer.train_state.step,
                 "seconds": round(took, 4)}
        self.healed_at.append(event)
        if trainer.mesh.is_main:  # for ``allhands drill`` and bench/replica.py
            with open(trainer.run_dir / "quorums.jsonl", "a") as f:
                f.write(json.dumps(event) + "\n")
        print(f"allhands: replica group {self.q.group}: quorum {q.qid} of groups "
              f"{', '.join(map(str, q.members))} at step {trainer.train_state.step}"
              f"{f' (healed from group {q.members[src]}, was at step {before})' if before != trainer.train_state.step else ''}"
              f" in {took:.2f} s", file=sys.stderr, flush=True)
        return True

    def reduce(self, parts: list[torch.nn.Module], step: int) -> bool:
        """Sum the gradients over the quorum, weighted by each group's share of the global
        batch. False: the step is discarded by every member (a member failed inside it)."""
        q = self.q.quorum
        share = len(q.slots(self.q.group, self.n)) / self.n
        params = [p for part in parts for p in part.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.mul_(share)
        ok = self.q.allreduce([p.grad for p in params], step)
        if not ok:
            print(f"allhands: replica group {self.q.group}: step {step + 1} discarded by every member "
                  f"of quorum {q.qid} (a member failed inside it); re-forming", file=sys.stderr, flush=True)
        return ok

    @property
    def stop(self) -> int:
        """The stop signal every member agreed on in the last all-reduce (0: none)."""
        return self.q.stop

    def finish(self, step: int) -> None:
        self.q.finish(step)
