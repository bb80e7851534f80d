"""What a mode changes in the one training loop: a set of hooks the loop calls at fixed points.

The loop (trainer.py) never asks which mode it runs; a mode that needs to act at a step boundary
(replica groups: form a quorum, heal, reduce over it, redo a discarded round) supplies its own
:class:`LoopHooks` and the default does nothing. TorchTitan's train loop and PyTorch Lightning's
callbacks are the same idea: adding a mode touches no line of the loop.
"""

from __future__ import annotations

from typing import Any

from allhands.stopflag import FLAG


class LoopHooks:
    """The default: lock-step training, nothing to add."""

    #: The loop may read the first step's batch ahead of the loop (to count FLOPs on it). A mode
    #: whose share of each batch is only known once the step begins says False.
    reads_ahead: bool = True

    def begin_step(self, trainer: Any) -> bool:
        """At a step boundary, before the batch is read. True: the state was replaced (healed
        from a peer), so the loop starts the step again from the new state."""
        return False

    def reduce(self, parts: list, step: int) -> bool:
        """After backward, before clipping: reconcile gradients beyond the layout's own. False:
        the step is discarded by every member (its gradients are dropped, nothing is consumed)."""
        return True

    def stop_signal(self) -> int:
        """The stop signal this rank brings to the step's agreement (0: none); stopflag.py."""
        return FLAG.signum

    def after_step(self, trainer: Any) -> bool:
        """After the update and the strategy's ``after_step``. True: the step's work was thrown
        away and the state rolled back (a discarded DiLoCo round), so the loop goes on from there."""
        return False
