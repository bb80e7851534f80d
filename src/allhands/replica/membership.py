"""What the replica groups agree on: a decided quorum (its members, their steps and
incarnations, how the global batch is shared among them), as one store value, and the outcomes a
group that waits for one may meet. The protocol that forms quorums and reduces over them is
quorum.py."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist

from allhands import collective


def shared_token(local: dist.ProcessGroup | None) -> str:
    """A fresh incarnation token, local rank 0's for every rank of ``local`` (a group's own world)."""
    token = torch.frombuffer(bytearray(secrets.token_hex(6).encode()), dtype=torch.uint8)
    if local is not None:
        collective.broadcast(token, call="replica incarnation", group=local, group_src=0)
    return bytes(token.numpy()).decode()


class QuorumFinished(Exception):
    """The other groups completed the job while this one was joining: nothing left to train."""


class QuorumStopped(Exception):
    """The job was stopped (a signal) while this group waited for a quorum."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum} while waiting for a quorum")
        self.signum = signum


@dataclass(frozen=True)
class Quorum:
    """A decided membership: quorum id, and per member (sorted by group) its step and incarnation."""

    qid: int
    members: tuple[int, ...]
    steps: tuple[int, ...]
    lives: tuple[str, ...]
    joiners: int  # the joiners counter when it was decided

    def encode(self) -> bytes:
        return ";".join([str(self.joiners)] + [f"{g}:{s}:{life}" for g, s, life in
                                               zip(self.members, self.steps, self.lives)]).encode()

    @classmethod
    def decode(cls, qid: int, raw: bytes) -> "Quorum":
        head, *items = raw.decode().split(";")
        parts = [item.split(":") for item in items]
        return cls(qid, tuple(int(p[0]) for p in parts), tuple(int(p[1]) for p in parts),
                   tuple(p[2] for p in parts), int(head))

    @property
    def source(self) -> int:
        """Index of the member whose state every member takes: the most advanced, lowest group."""
        best = max(self.steps)
        return self.steps.index(best)

    def slots(self, group: int, n_groups: int) -> list[int]:
        """The shares of the global batch this group computes. The global batch is always cut
        into ``n_groups`` shares (the sampler's ranks); member i of k takes shares i, i+k, ..."""
        i, k = self.members.index(group), len(self.members)
        return list(range(i, n_groups, k))
