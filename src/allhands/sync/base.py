"""The seam between the training loop and a reconciliation strategy.

The loop calls, in order, for each optimizer step::

    for i, micro in enumerate(micro_batches):
        with strategy.micro_step(model, last=(i == len - 1)):
            forward; backward
    clip; optimizer.step(); strategy.after_step(step)

and, when it checks or evaluates replicas, asks ``strategy.in_sync(step)`` whether the replicas
are meant to be identical after that step (always for all-reduce; only at outer syncs for
DiLoCo and local SGD). Every collective a strategy launches is recorded in ``strategy.comm``
(sync/comm.py), which the loop reads when it logs.

A strategy that keeps state (an outer optimizer, error feedback) exposes it through
``state_dict`` / ``load_state_dict`` and is checkpointed under the key ``sync``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from allhands.mesh import Mesh
from allhands.sync.comm import CommMeter


class SyncStrategy:
    name = "base"
    # False: parallelize() reconciles the data-parallel replicas every step (DDP, or FSDP's
    # hybrid all-reduce over dp_replicate). True: this strategy does it itself (DiLoCo), so
    # parallelize() only shards over dp_shard and leaves dp_replicate alone.
    reconciles_replicas = False
    # True: the loop may agree with every worker each step (its non-finite check is one
    # all-reduce). False: workers run at their own pace (asynchronous parameter server).
    lockstep = True

    def __init__(self) -> None:
        self.comm = CommMeter()

    def wrap(self, model: nn.Module, mesh: Mesh) -> nn.Module:
        """Return the module the loop runs forward/backward on."""
        raise NotImplementedError

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once with the optimizer the loop steps (DiLoCo keeps each replica's state)."""

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_step(self, step: int) -> None:
        """Called after each optimizer step with the number of completed steps."""

    def replica_state(self) -> list[torch.Tensor]:
        """Replica mode: tensors of this strategy's state a healing group takes from its source
        (replica/heal.py), in an order alike on every group."""
        return []

    def in_sync(self, step: int) -> bool:
        """Whether every replica holds the same parameters after ``step`` completed steps."""
        return True

    def describe(self) -> str:
        """One line for the run's log: what this strategy does."""
        return self.name

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def saved_keys(self, keys: set[str]) -> None:
        """Called before a load with the checkpoint's flattened keys (``sync.…`` among them), so
        that the next ``state_dict`` asks only for entries the checkpoint has: per-rank or
        per-replica state of a rank or replica that did not exist when it was saved."""
