"""allhands' own collectives (metrics, evaluation, memory records, agreement, checkpoints, the
quorum, the parameter server's messages) in one place that knows the device each process group
serves, and refuses a tensor of another device with one line naming the call.

Why: on CUDA the default group is NCCL alone, and a CPU tensor sent on it fails deep in torch
("No backend type associated with device type cpu") without saying whose tensor it was; gloo
groups made for host values (the quorum, the parameter server, checkpoint agreement) must not
be handed CUDA tensors either. The mesh (mesh.py) registers every group it makes with its device;
a group nobody registered serves the default group's device. The gradient collectives of torch's
own wrappers (DDP, FSDP, DTensor) do not pass here.

A device tensor that must cross a host group travels through a pinned host buffer
(:func:`to_host`, :func:`host_empty`), so the copy is a plain DMA rather than a pageable one.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

# group -> the device its tensors live on. Weak keys: a destroyed group's entry goes with it
# (a strong one would keep its gloo connections open).
_SERVES: "weakref.WeakKeyDictionary[Any, torch.device]" = weakref.WeakKeyDictionary()
_CPU = torch.device("cpu")
SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX


class CollectiveDeviceError(ValueError):
    """A tensor of one device handed to a group that serves another (a bug of the caller).
    Not a RuntimeError: callers that take a RuntimeError for a lost peer must not retry it."""


def register(group: Any, device: torch.device | str) -> Any:
    """Record that ``group`` carries tensors of ``device``; returns ``group``."""
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        _SERVES[group] = torch.device(device)
    return group


def device(group: Any = None) -> torch.device:
    """The device of the tensors ``group`` (None: the default group) carries."""
    world = dist.group.WORLD if dist.is_initialized() else None
    for g in (group, world):
        if g is not None and g in _SERVES:
            return _SERVES[g]
    if world is None:
        return _CPU
    # Nobody registered the default group (a process group made outside the mesh): torch's own
    # view. A gloo group lists cuda and cpu both; NCCL cuda alone.
    types = {d.type for d in world._device_types}
    return _CPU if "cpu" in types or not types else torch.device(sorted(types)[0])


def check(call: str, op: str, tensors: list[torch.Tensor], group: Any = None) -> None:
    """Raise :class:`CollectiveDeviceError` unless every tensor is on ``group``'s device."""
    want = device(group).type
    for t in tensors:
        if t.device.type != want:
            raise CollectiveDeviceError(
                f"{call}: {op} of a {t.device.type} tensor on a group that serves {want}; build "
                f"it on collective.device(group), or stage it through the host for a host group")


# --------------------------------------------------------------------------- collectives
# A group may be a bare backend made over a store of its own (the quorum's ProcessGroupGloo, the
# parameter server's cross-role group): torch's collective functions refuse one that the default
# group's world does not list, so its own methods are called instead.


def _bare(group: Any) -> bool:
    return group is not None and not isinstance(group, dist.ProcessGroup)


def all_reduce(t: torch.Tensor, *, call: str, group: Any = None,
               op: dist.ReduceOp.RedOpType = SUM) -> None:
    check(call, "all_reduce", [t], group)
    if _bare(group):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        group.allreduce([t], opts).wait()
    else:
        dist.all_reduce(t, op=op, group=group)


def all_gather(out: list[torch.Tensor], t: torch.Tensor, *, call: str, group: Any = None) -> None:
    check(call, "all_gather", [t, *out], group)
    if _bare(group):
        group.allgather([out], [t]).wait()
    else:
        dist.all_gather(out, t, group=group)


def broadcast(t: torch.Tensor, *, call: str, group: Any = None, src: int | None = None,
              group_src: int | None = None) -> None:
    """``src``: a global rank; ``group_src``: a rank of ``group`` (a bare backend's: only this)."""
    check(call, "broadcast", [t], group)
    if _bare(group):
        opts = dist.BroadcastOptions()
        opts.rootRank = group_src
        group.broadcast([t], opts).wait()
    else:
        dist.broadcast(t, src=src, group=group, group_src=group_src)


def all_to_all_single(out: torch.Tensor, t: torch.Tensor, out_splits: list[int] | None = None,
                      in_splits: list[int] | None = None, *, call: str, group: Any = None) -> None:
    check(call, "all_to_all", [t, out], group)
    dist.all_to_all_single(out, t, out_splits, in_splits, group=group)


def send(t: torch.Tensor, dst: int, *, call: str, group: Any, tag: int = 0) -> dist.Work:
    """Post a send to rank ``dst`` of ``group`` (a bare backend too); the caller waits on the
    returned work."""
    check(call, "send", [t], group)
    return group.send([t], dst, tag)


def recv(t: torch.Tensor, src: int | None, *, call: str, group: Any, tag: int = 0) -> dist.Work:
    """Post a receive from rank ``src`` of ``group`` (None: from any rank)."""
    check(call, "recv", [t], group)
    return group.recv_anysource([t], tag) if src is None else group.recv([t], src, tag)


# --------------------------------------------------------------------------- host staging


def host_empty(shape: tuple[int, ...] | int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """An empty host buffer; ``pinned`` (for data to or from a GPU) where CUDA is, so the copies
    are DMA. A buffer only the host touches stays pageable: pinning would start CUDA in a
    process that trains on the CPU of a GPU machine."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned and torch.cuda.is_available())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: itself when it is there already, else a pinned copy."""
    if t.device.type == "cpu":
        return t
    return host_empty(t.shape, t.dtype, pinned=True).copy_(t)
