"""The seam between the training loop and a reconciliation strategy.

The loop calls, in order, for each optimizer step::

    for i, micro in enumerate(micro_batches):
        with strategy.micro_step(model, last=(i == len - 1)):
            forward; backward
    clip; optimizer.step(); strategy.after_step(step)

A strategy that keeps state (an outer optimizer, error feedback) exposes it through
``state_dict`` / ``load_state_dict`` and is checkpointed under the key ``sync``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.nn as nn

from allhands.mesh import Mesh


class SyncStrategy:
    name = "base"
    # False: parallelize() reconciles the data-parallel replicas every step (DDP, or FSDP's
    # hybrid all-reduce over dp_replicate). True: this strategy does it itself (DiLoCo), so
    # parallelize() only shards over dp_shard and leaves dp_replicate alone.
    reconciles_replicas = False

    def wrap(self, model: nn.Module, mesh: Mesh) -> nn.Module:
        """Return the module the loop runs forward/backward on."""
        raise NotImplementedError

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_step(self, step: int) -> None:
        """Called after each optimizer step with the number of completed steps."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
