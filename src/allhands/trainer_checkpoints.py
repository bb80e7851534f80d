"""What a training run saves, loads and rolls back: the checkpoint contract under fixed keys
(model + optimizer, scheduler, train state, RNG, sync strategy), resuming from the newest
committed checkpoint that verifies, a clean stop's final save, and the roll-back after a
non-finite step. A mixin of the Trainer (trainer.py), whose attributes it reads: ``cfg``,
``mesh``, ``layout``, ``scheduler``, ``train_state``, ``rng_state``, ``strategy``, ``ckpt``,
``run_dir``, ``resume_also``, ``saved_step`` and ``rollbacks``."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from allhands.checkpoint import ModelOptimState, SchedulerState, check_compatible, seed_rank
from allhands.errors import CheckpointError
from allhands.metrics import MetricsWriter
from allhands.stopflag import CleanStop


class RunCheckpoints:
    def state(self) -> dict[str, Any]:
        return {"model": ModelOptimState(*self.layout.checkpoint_parts()),
                "scheduler": SchedulerState(self.scheduler),
                "train": self.train_state, "rng": self.rng_state, "sync": self.strategy}

    def maybe_resume(self) -> bool:
        """Load the newest committed checkpoint that verifies (falling back past damaged ones)."""

        def state_for(step: int, path: Path) -> dict[str, Any]:
            check_compatible(path, self.cfg.to_dict())
            state = self.state()
            keys = self.ckpt.saved_keys(path)
            self.strategy.saved_keys(keys)  # before DCP asks it for its state_dict
            if not any(k.startswith(f"rng.{self.rng_state.key}.") for k in keys):
                # A rank that did not exist when this was saved (resume on more workers): its
                # generators are re-seeded from (seed, rank, step), reproducibly.
                del state["rng"]
                seed_rank(self.cfg.run.seed + step, self.mesh.rank)
            return state

        warn = (lambda m: print(m, file=sys.stderr, flush=True)) if self.mesh.is_main else (lambda m: None)
        loaded = self.ckpt.load_latest(state_for, warn, also=self.resume_also)
        if loaded is None:
            return False
        step, path = loaded
        if self.train_state.step != step:
            raise CheckpointError(f"checkpoint {str(path)!r} says step {self.train_state.step}, "
                                  f"its name says {step}; the checkpoint is inconsistent")
        return True

    def save(self) -> None:
        self.ckpt.save(self.train_state.step, self.state())
        self.saved_step = self.train_state.step

    def _stop_cleanly(self, signum: int) -> None:
        """Every rank stopped after the same step: commit its checkpoint (unless the cadence just
        saved it), let the save finish, and raise CleanStop for the worker to exit with."""
        if self.saved_step != self.train_state.step:
            self.save()
        self.ckpt.wait()  # collective: the save in flight is committed or given up on every rank
        latest = self.ckpt.latest()
        raise CleanStop(signum, latest[0] if latest else 0, latest[1] if latest else None, self.run_dir)


    def _report_checkpoint_warnings(self, metrics: MetricsWriter) -> None:
        for w in self.ckpt.warnings:
            metrics.message(f"allhands: warning: {w}")
        if self.ckpt.warnings:  # a failed save surfaces asynchronously: its own metrics line
            metrics.log({"step": self.train_state.step, "checkpoint_failures": self.ckpt.failures,
                         "time": time.time()})
        self.ckpt.warnings.clear()

    def _rollback(self, metrics: MetricsWriter) -> bool:
        """Reload the last committed checkpoint after a non-finite step; False if there is none
        (the step is then skipped)."""
        self.ckpt.wait()
        ts = self.train_state
        skips, bad_step = ts.nonfinite_skips + 1, ts.step + 1
        if self.ckpt.latest() is None:
            return False
        self.maybe_resume()
        ts.nonfinite_skips = skips
        self.rollbacks += 1
        metrics.message(f"allhands: warning: non-finite loss or gradient at step {bad_step}; rolled "
                        f"back to step {ts.step} (rollback {self.rollbacks})")
        return True

