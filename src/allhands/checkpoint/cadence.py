"""When to checkpoint: every ``checkpoint.interval`` steps, or, with ``checkpoint.max_overhead``,
as often as a bound on the time checkpointing adds to training allows.

The bound is CheckFreq's rule (Mohan et al., "CheckFreq: Frequent, Fine-Grained DNN
Checkpointing", FAST'21, section 4.3): measure the step time ``t`` without a save and the time
``c`` one save adds (the training thread's stall plus the slowdown of the steps that ran while
it was written in the background), then save every ``k`` steps with ``c / (k * t) <= bound``.
Here ``k`` is the smallest multiple of ``checkpoint.interval`` that satisfies it, so the interval
is also the granularity (DiLoCo's rule that saves fall on outer-sync steps still holds) and
``max_overhead = 0`` is exactly the fixed interval.

Every rank must save at the same steps (a save is collective), so the measured ``c`` and ``t`` are
reduced (max over ranks) at each save step, which every rank reaches alike.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from allhands import collective


class Cadence:
    """Decides the save steps; fed with each step's time and whether a save was in flight."""

    def __init__(self, interval: int, max_overhead: float, start_step: int, device: torch.device):
        self.base = interval
        self.bound = max_overhead
        self.interval = interval
        self.device = device
        self.next = (start_step // interval + 1) * interval if interval else None
        self.clean: deque[float] = deque(maxlen=64)  # step seconds with no save in flight
        self.busy: list[float] = []  # step seconds while the last save was in flight
        self.stall = 0.0  # seconds the training thread spent in the last save call
        self.measured = False  # whether a save happened whose cost the steps after it show
        # The last pick's inputs as every rank used them (after the max over ranks), for the
        # metrics line of each save: what the rule saw, so a run shows why it saves when it does.
        self.inputs: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return self.next is not None and step >= self.next

    def step_done(self, seconds: float, save_in_flight: bool) -> None:
        (self.busy if save_in_flight else self.clean).append(seconds)

    def save(self, step: int, save: Callable[[], None]) -> str | None:
        """Run ``save`` (collective) for ``step`` and schedule the next one. Returns a line for
        the log when the interval changed."""
        note = self._repick() if self.bound > 0 and self.base else None
        t0 = time.perf_counter()
        save()
        self.stall = time.perf_counter() - t0
        self.busy = []
        self.measured = True
        if self.next is not None:
            self.next = step + self.interval
        return note

    def _repick(self) -> str | None:
        if not self.measured or not self.clean:
            return None
        t = statistics.median(self.clean)
        cost = self.stall + sum(max(0.0, s - t) for s in self.busy)
        both = torch.tensor([cost, t], dtype=torch.float64, device=self.device)
        if dist.is_initialized():  # every rank picks the same interval: the slowest rank's figures
            collective.all_reduce(both, op=collective.MAX, call="checkpoint cadence")
        cost, t = both.tolist()
        self.inputs = {"checkpoint_cost_s": cost, "checkpoint_step_time_s": t}
        multiple = max(1, math.ceil(cost / (self.bound * t * self.base))) if t > 0 else 1
        old, self.interval = self.interval, multiple * self.base
        if self.interval == old:
            return None
        return (f"allhands: checkpoint interval {old} -> {self.interval} steps: a save adds "
                f"{cost:.3f} s, a step takes {t:.3f} s, so saving every {self.interval} steps costs "
                f"{100 * cost / (self.interval * t):.1f}% <= checkpoint.max_overhead "
                f"{100 * self.bound:g}% (CheckFreq's rule, in multiples of checkpoint.interval)")
