"""Heal: a replica group that joins a quorum takes the model, optimizer, schedule and step of the
quorum's most advanced member, sent as tensors by a broadcast over the quorum's process group
(the layout travels as JSON, never as a pickle); and the mode's loop hooks (hooks.py) that run
the quorum (replica/quorum.py) at each step boundary of the one training loop.

After a heal every member holds bit-identical parameters and optimizer state, and from then on
they apply the same summed gradient, so they stay identical. The data cursor is the step
(data/sampler.py), so it travels as one number.

With FSDP inside a group, local rank L of every group holds the same slice of every parameter
and of its optimizer state (``fully_shard`` cuts alike for the same world size), so each local
rank heals over its own quorum group (the same local rank of every member) with the local
tensors of its DTensors, and reduces its gradient shard the same way.

Under DiLoCo the groups are its replicas: inner steps are local, and the outer sync over the
quorum is the step that commits. Each member keeps its state at the last committed boundary (the
anchor, plus a copy of the inner optimizer, schedule and step) so that a round a member failed
in is discarded by all and redone from there; a heal then also sends the anchor and the outer
momentum.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from allhands import collective
from allhands.hooks import LoopHooks
from allhands.memory import local
from allhands.replica.quorum import Quorum, ReplicaQuorum


def _bcast(pg: dist.ProcessGroup, tensors: list[torch.Tensor], src: int) -> None:
    for t in tensors:
        collective.broadcast(t, call="replica heal", group=pg, group_src=src)


_BUCKET_BYTES = 32 << 20  # at most this much state is copied into one flat buffer at a time


def _bcast_coalesced(pg: dist.ProcessGroup, tensors: list[torch.Tensor], src: int, me: int) -> None:
    """Broadcast ``tensors`` from ``src`` in place, as flat buckets of one dtype each instead of one
    collective per tensor: a heal moves about three tensors per parameter, and each collective
    costs a round trip (on a slow link, its latency). The buckets are cut alike on every member,
    since every member's tensors have the source's shapes and dtypes (the layout). A bucket is a
    host buffer (the quorum's group is gloo), pinned where it meets a GPU's tensors, whose
    pieces may live on different devices (AdamW's ``step`` stays on the host), and where each
    one does is not part of the layout: a fresh member's may differ from the source's."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in [*tensors, None]:
        if bucket and (t is None or t.dtype != bucket[0].dtype or size + t.numel() * t.element_size() > _BUCKET_BYTES):
            numels = [b.numel() for b in bucket]
            flat = collective.host_empty(sum(numels), bucket[0].dtype,
                                         pinned=any(b.device.type != "cpu" for b in bucket))
            if me == src:
                for piece, b in zip(flat.split(numels), bucket):
                    piece.copy_(b.reshape(-1))
            _bcast(pg, [flat], src)
            if me != src:
                for piece, b in zip(flat.split(numels), bucket):
                    b.copy_(piece.view_as(b))
            bucket, size = [], 0
        if t is not None:
            bucket.append(t)
            size += t.numel() * t.element_size()


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


def heal(trainer: Any, pg: dist.ProcessGroup, src: int, me: int,
         midway: Callable[[], None] | None = None) -> None:
    """Collective over ``pg``: every member ends with member ``src``'s training state; or, when
    the broadcast fails (a member died inside it: gloo raises RuntimeError), with its own state
    untouched. A receiver takes the tensors into buffers of its own and puts them in place only
    once all of them arrived, so nothing half-healed ever trains. ``midway`` runs after half the
    tensors (fault injection: faults.py ``heal``)."""
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
    # Where each tensor goes (on the source: what it sends): parameters, optimizer moments, and
    # the strategy's own state (DiLoCo: the global model and outer momentum). Local shards under
    # FSDP: worker L of every group holds the same slice.
    targets = [local(p.detach()) for p in params]
    fresh: list[tuple[dict, str, torch.Tensor]] = []  # moments a fresh process does not hold yet
    for p, entry in zip(params, layout["state"]):
        held = opt.state[p]  # a defaultdict: a fresh process has no state yet
        for k, (kind, *rest) in entry.items():
            if kind == "v":
                continue
            shape, dtype = rest[0], getattr(torch, rest[1])
            t = held.get(k)
            if not (torch.is_tensor(t) and list(t.shape) == shape and t.dtype == dtype):
                # a moment shaped like its parameter is laid out like it (a DTensor under FSDP)
                t = (torch.zeros_like(p.detach(), dtype=dtype) if list(p.shape) == shape
                     else torch.zeros(shape, dtype=dtype, device=p.device))
                fresh.append((held, k, t))
            targets.append(local(t))
    targets += trainer.strategy.replica_state()
    # A receiver fills buffers of its own and puts them in place only once all of them arrived.
    tensors = targets if me == src else [torch.empty_like(t) for t in targets]
    half = len(tensors) // 2
    _bcast_coalesced(pg, tensors[:half], src, me)
    if midway is not None:
        midway()
    _bcast_coalesced(pg, tensors[half:], src, me)
    if me == src:
        return
    for old, new in zip(targets, tensors):
        old.copy_(new)
    for held, k, t in fresh:
        held[k] = t
    for p, entry in zip(params, layout["state"]):
        for k, (kind, *rest) in entry.items():
            if kind == "v":
                opt.state[p][k] = rest[0]
    for group, hyper in zip(opt.param_groups, layout["groups"]):
        for k, v in hyper.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    trainer.scheduler.load_state_dict({**trainer.scheduler.state_dict(), **layout["scheduler"]})
    trainer.train_state.load_state_dict(layout["train"])  # its own contract: every field travels


class ReplicaGroup(LoopHooks):
    """Replica mode inside one group's worker: the trainer's sampler (this group's shares of each
    global batch under the current quorum), and its loop hooks: the quorum at each step boundary,
    the reduce over it, the stop it agreed on, a discarded DiLoCo round redone."""

    reads_ahead = False  # a group's share of a batch is known only once its quorum is formed

    def __init__(self, quorum: ReplicaQuorum, trainer: Any):
        self.q, self.n = quorum, quorum.n
        self.sampler = trainer.sampler
        trainer.sampler = self  # the loop asks this object for its micro-batches
        trainer.hooks = self
        self.healed_at: list[dict[str, Any]] = []
        self.held = time.time()
        # DiLoCo: groups are its replicas; inner steps are local, and the outer sync over the
        # quorum is what commits or is discarded (a discarded round is redone from its start).
        self.diloco = trainer.strategy if trainer.strategy.name == "diloco" else None
        if self.diloco is not None:
            self.diloco.outer_reduce = lambda delta: self._outer(trainer, delta)
        self.round_start: dict[str, Any] = {}

    def local_micro_batches(self, step: int, rank: int, world: int, micro_batches: int) -> list[list[int]]:
        """This rank's part of its group's shares of step ``step``: ``rank``/``world`` are its
        group's own (FSDP's ranks: share s of the global batch is the sampler's ranks
        s * world ... s * world + world - 1, as in a full run's HSDP mesh)."""
        q = self.q.quorum
        assert q is not None, "the quorum is formed at the top of each step"
        return [mb for s in q.slots(self.q.group, self.n)
                for mb in self.sampler.local_micro_batches(step, s * world + rank, self.n * world,
                                                           micro_batches)]

    def begin_step(self, trainer: Any) -> bool:
        """At a step boundary: form a new quorum when one is due (a failure, a joiner, the
        start) and take its source's state; a heal a member died inside leaves every state as it
        was, and the quorum forms again without the dead. True when the state was replaced."""
        if not self.q.reform:
            return False
        t0, began = time.perf_counter(), time.time()
        step = trainer.train_state.step
        while True:
            q: Quorum = self.q.form(step, on_wait=lambda: trainer.heartbeat.beat(step + 1))
            formed = time.time()  # the timeline of a fault (bench/replica.py): form, then heal
            src, me = q.source, q.members.index(self.q.group)
            before = trainer.train_state.step
            behind = [s != q.steps[src] for s in q.steps]  # whose state this heal moves
            hook = trainer.faults.heal_hook(q.steps[src], me == src) if any(behind) and (
                me == src or behind[me]) else None
            try:
                heal(trainer, self.q.pg, src, me, hook)
                break
            except RuntimeError as e:  # gloo: a member died inside the broadcast
                self.q.reform, self.q.pg = True, None  # its connections close now
                print(f"allhands: replica group {self.q.group}: the heal in quorum {q.qid} failed "
                      f"({str(e).splitlines()[0][:160]}); state untouched, re-forming",
                      file=sys.stderr, flush=True)
        took = time.perf_counter() - t0
        event = {"time": time.time(), "pid": os.getpid(), "quorum": q.qid, "members": list(q.members),
                 "from_group": q.members[src], "was_at": before, "step": trainer.train_state.step,
                 "seconds": round(took, 4), "began": began, "formed": formed}
        if not self.healed_at:  # this process's first quorum: since it held its group (a spare: handed it)
            event["held"] = self.held
        self.healed_at.append(event)
        if trainer.mesh.is_main:  # for ``allhands drill`` and bench/replica.py
            with open(trainer.run_dir / "quorums.jsonl", "a") as f:
                f.write(json.dumps(event) + "\n")
        print(f"allhands: replica group {self.q.group}: quorum {q.qid} of groups "
              f"{', '.join(map(str, q.members))} at step {trainer.train_state.step}"
              f"{f' (healed from group {q.members[src]}, was at step {before})' if before != trainer.train_state.step else ''}"
              f" in {took:.2f} s", file=sys.stderr, flush=True)
        if self.diloco is not None:  # a heal is at an outer boundary: a round starts here
            self.diloco.step = trainer.train_state.step
            self._keep_round_start(trainer)
        return True

    def _keep_round_start(self, trainer: Any) -> None:
        """What a discarded DiLoCo round rolls back to, besides the anchor (the parameters at
        the round's start): the inner optimizer, schedule and step at that boundary."""
        self.round_start = copy.deepcopy({"optim": trainer.optimizer.state_dict(),
                                          "sched": trainer.scheduler.state_dict(),
                                          "train": trainer.train_state.state_dict()})

    def _outer(self, trainer: Any, delta: torch.Tensor) -> torch.Tensor | None:
        """DiLoCo's outer average over the quorum: each member's pseudo-gradient weighted by its
        share of the global batch (the mean in an undisturbed run); None: the round is discarded."""
        q, step = self.q.quorum, trainer.train_state.step
        avg = delta * (len(q.slots(self.q.group, self.n)) / self.n)
        if not self.q.allreduce([avg], step):
            print(f"allhands: replica group {self.q.group}: the outer round ending at step {step} is "
                  f"discarded by every member of quorum {q.qid} (a member failed in it); redoing it",
                  file=sys.stderr, flush=True)
            return None
        self._keep_round_start(trainer)  # the next round starts from this boundary
        return avg

    def after_step(self, trainer: Any) -> bool:
        """After a step: True when its outer sync was discarded; the state is then back at the
        round's start (parameters = anchor, inner optimizer, schedule, step) to redo the round."""
        s = self.diloco
        if s is None or not s.discarded:
            return False
        s.discarded = False
        start = copy.deepcopy(self.round_start)  # the optimizer keeps the tensors it is given
        with torch.no_grad():
            for p, a in zip(s.params, s.anchor):
                local(p).copy_(a)
        trainer.optimizer.load_state_dict(start["optim"])
        trainer.scheduler.load_state_dict(start["sched"])
        trainer.train_state.load_state_dict(start["train"])
        s.step = trainer.train_state.step
        return True

    def reduce(self, parts: list[torch.nn.Module], step: int) -> bool:
        """Sum the gradients over the quorum, weighted by each group's share of the global
        batch. False: the step is discarded by every member (a member failed inside it)."""
        if self.diloco is not None:
            return True  # DiLoCo's inner steps are local; its outer sync goes through _outer
        q = self.q.quorum
        share = len(q.slots(self.q.group, self.n)) / self.n
        params = [p for part in parts for p in part.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.mul_(share)
        ok = self.q.allreduce([local(p.grad) for p in params], step)  # FSDP: this rank's shard
        if not ok:
            print(f"allhands: replica group {self.q.group}: step {step + 1} discarded by every member "
                  f"of quorum {q.qid} (a member failed inside it); re-forming", file=sys.stderr, flush=True)
        return ok

    def stop_signal(self) -> int:
        """The stop signal every member agreed on in the quorum's last all-reduce (0: none)."""
        return self.q.stop

    def finish(self, step: int) -> None:
        self.q.finish(step)
