"""What the ranks agree on around each step, at the least cost: whether the step's update is
skipped (a non-finite loss or gradient, faults.NonFiniteGuard) and whether to stop after it
(stopflag.py).

Skipping: where the strategy reconciles the gradients every step (``SyncStrategy.grads_agree``:
DDP, FSDP, tensor and pipeline parallel under the all-reduce strategy), every rank computes its
gradient norm from the same reduced gradients (the norm's own all-reduce over shards and stages
is part of clipping), so each rank's local ``isfinite(norm)`` is the same decision and needs no
collective. A NaN or Inf in any rank's gradient reaches every rank through the sum, and a
non-finite loss makes its own gradients non-finite (autograd carries NaN/Inf back), so such a
step is skipped on every rank at once. Not caught: a non-finite loss whose gradients are all
finite (its non-finite term has no gradient): every rank applies that update alike, and the
loss shows as NaN in the next logged record. What stays per step is one host sync of that flag
(the policy's count, its in-a-row limit and a rollback are decided on the host at that step).
Strategies whose replicas do not reconcile every step (DiLoCo, local SGD, the synchronous
parameter server) keep one all_reduce of [non-finite, stop] per step; an asynchronous worker
decides alone.

Stopping: the request rides on the logged step's all_gather (steplog.py) and, between logged
steps, on one 2-value all_reduce every ``k`` steps, ``k = ceil(STOP_CHECK_S / step time)``, the
step time being the slowest rank's as that collective (or the log's) reported it, so every rank
computes the same ``k``. A stop signal therefore ends the job within about STOP_CHECK_S plus a
step, alike on every rank. An asynchronous worker agrees only at its logged steps, where it meets
its peers anyway.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from allhands import collective
from allhands.faults import NonFiniteGuard

STOP_CHECK_S = 1.0  # between logged steps, agree on a stop about once a second of training


class StepAgreement:
    """Called by the loop before each update (``update``) and after each step (``stop``)."""

    def __init__(self, guard: NonFiniteGuard, *, lockstep: bool, grads_agree: bool,
                 device: torch.device, stop_signal):
        self.guard, self.device, self.stop_signal = guard, device, stop_signal
        self.lockstep = lockstep
        self.per_step = lockstep and not grads_agree  # the flags' all_reduce every step
        self.grads_agree = lockstep and grads_agree
        self.next_check = 0  # the first step after which a lock-step world agrees on a stop
        self._carried = 0  # the stop agreed in this step's flags (per_step only)
        self._bad: torch.Tensor | None = None  # device counters between two reads (_on_device)
        self.skipped, self.skipped_at = 0, ""  # updates the last read found skipped, and where

    def update(self, loss_sum: torch.Tensor, gnorm: torch.Tensor, step: int,
               skip_on_device: Callable[[torch.Tensor], bool] | None = None, read: bool = True) -> str:
        """Before the optimizer step of ``step``: 'ok', 'skip' or 'rollback', alike on every
        rank (raises NonFiniteError when the policy stops). ``skip_on_device(bad)``: makes the
        optimizer's next step skip itself where the 0-dim ``bad`` is 1, False if it cannot
        (optim.skip_on_device). Where the gradients agree and it can, the skip is decided on the
        device (:meth:`_on_device`) and 'ok' returned; the host reads the verdict only when
        ``read`` (a logged step, which syncs anyway)."""
        self.skipped = 0
        if self.grads_agree and skip_on_device is not None and self.guard.policy != "rollback":
            if self._on_device(gnorm, step, skip_on_device, read):
                return "ok"
        if self.per_step:
            flags = torch.tensor([0.0 if _finite(loss_sum, gnorm) else 1.0, float(self.stop_signal())],
                                 device=self.device)
            collective.all_reduce(flags, op=collective.MAX, call="agree (skip, stop)")
            bad, stop = flags.tolist()
            self._carried = int(stop)
            finite = not bad
        elif self.grads_agree:
            finite = bool(torch.isfinite(gnorm))  # the same reduced norm on every rank
        else:  # an asynchronous worker decides alone
            finite = _finite(loss_sum, gnorm)
        return self.guard.check(finite, step)

    def _on_device(self, gnorm: torch.Tensor, step: int,
                   skip_on_device: Callable[[torch.Tensor], bool], read: bool) -> bool:
        """The skip without a host sync: the optimizer's fused kernels skip the update where the
        norm is not finite, and device counters keep what the guard needs (bad steps, the
        longest run in a row, the first and last bad step), read on a logged step. The guard's
        verdict for the steps since the last read is applied then: a stop raises, skips are
        counted in ``skipped``. False where the optimizer cannot skip on the device."""
        bad = (~torch.isfinite(gnorm)).to(torch.float32)
        if not skip_on_device(bad):
            return False
        if self._bad is None:  # bad steps, in a row now, longest run, first and last bad step
            self._bad = torch.zeros(5, dtype=torch.float32, device=bad.device)
            self._bad[1] = float(self.guard.in_row)
        b = self._bad
        in_row = (b[1] + 1) * bad
        at = torch.full((), float(step), device=bad.device)
        self._bad = torch.stack([b[0] + bad, in_row, torch.maximum(b[2], in_row),
                                 torch.where((bad > 0) & (b[3] == 0), at, b[3]),
                                 torch.where(bad > 0, at, b[4])])
        if not read:
            return True
        total, in_row_now, longest, first, last = (int(v) for v in self._bad.tolist())
        self._bad = None
        self.guard.in_row = in_row_now
        if not total:
            return True
        where = f"step {last}" if first == last else f"{total} steps from step {first} to {last}"
        self.guard.check_window(longest, where, last)
        self.skipped, self.skipped_at = total, where
        return True

    def stop(self, step: int, dt: float, logged: tuple[int, float] | None) -> int:
        """After ``step`` completed: the stop signal every rank agreed on now, 0 if none (or no
        agreement is due at this step). ``logged``: (the agreed stop, the agreed step time) from
        this step's logged record, or None on a step that did not log."""
        if self.per_step:
            return self._carried
        if logged is not None:
            stop, step_time = logged
        elif not self.lockstep or step < self.next_check:
            return 0
        else:
            both = torch.tensor([float(self.stop_signal()), dt], dtype=torch.float64, device=self.device)
            collective.all_reduce(both, op=collective.MAX, call="agree (stop)")
            stop, step_time = both.tolist()
        self.next_check = step + max(1, math.ceil(STOP_CHECK_S / max(step_time, 1e-9)))
        return int(stop)


def _finite(loss_sum: torch.Tensor, gnorm: torch.Tensor) -> bool:
    return bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(gnorm))
