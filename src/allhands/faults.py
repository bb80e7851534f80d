"""Deterministic fault injection and the policy for non-finite numbers.

A fault is ``RANK:STEP:KIND`` (config ``fault.inject``, comma separated): worker ``RANK`` fails
while computing update ``STEP`` (1-based, the step number metrics.jsonl shows), as torchft's
``fail_at(rank, step)`` does. Each fault fires once per run directory: a marker file
``faults/RANK-STEP-KIND`` is written (with the wall time, for drills) before it fires, so the
restarted job, which recomputes the steps since the last checkpoint, passes the same step
unharmed. The same spec on a fresh run directory replays the same failure.

Kinds:
- a signal name (``SIGKILL``, ``SIGTERM``, ``SIGSEGV``, ...): the worker sends it to itself after
  the forward pass, before backward ("mid-step"); SIGINT, SIGTERM and SIGUSR1 ask for a clean
  stop at the end of this step (stopflag.py);
- ``launcher-SIGNAL`` (SIGINT, SIGTERM, SIGUSR1): the worker sends the signal to its launcher
  after the forward pass and waits until the launcher has forwarded it back, so that the job
  stops cleanly at the end of exactly this step (how the tests time a Ctrl-C); ``launcher-SIGKILL``:
  the launcher dies at once, and its workers, sent SIGINT as it goes, stop after this step;
- ``exception`` / ``oom``: raise ``RuntimeError`` / ``torch.OutOfMemoryError`` after forward;
- ``hang``: sleep forever before the step starts (the hang watchdog must find it);
- ``nan``: multiply this rank's loss by NaN (the gradients all-reduce to NaN everywhere);
- ``ckpt``: SIGKILL inside the storage writer of the first checkpoint saved at or after STEP,
  after this rank's shard files are written but before the save completes, i.e. during an
  (asynchronous) checkpoint write;
- ``heal-source`` / ``heal-joiner``: SIGKILL in the middle of a replica-mode heal
  (replica/heal.py), after half of the state's tensors were broadcast: the first heal to a step
  at or after STEP in which this replica group is the source (and some member is behind) / a
  member that is behind (a joiner);
- ``ps-push``: SIGKILL of a parameter-server worker in the middle of the push of step STEP (at
  or after it, once): every other server received its whole piece, the last server the request's
  header but none of its payload (ps/client.py);
- ``flake``: the start-up flake of a fresh gloo process group (seen with torch 2.13: a restart
  failed once in ``connectFullMesh`` and the next try worked): the first attempt that starts at step
  STEP or later fails before computing any step, raising the ``RuntimeError`` gloo raises when
  ``connectFullMesh`` cannot reach a peer. The restart policy must retry it without counting it
  against ``fault.max_restarts`` (launch/policy.py). Raising gloo's words rather than
  breaking the real connection: the real flake needs a stale peer address in the worker store,
  which the fresh store per round (rendezvous.py) no longer leaves behind, so it cannot be
  provoked on purpose; what is tested is everything after it (classification, retry, report).
- ``slow=F`` (F > 1): a straggler. From step STEP on, this rank sleeps before each step F - 1
  times as long as its previous step's work took, so its steps take F times as long; not
  fire-once (a slow machine stays slow after a restart) and deterministic given the work time.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from allhands.env import worker_env
from allhands.errors import AllhandsError, ConfigError
from allhands.stopflag import FLAG, STOP_SIGNALS

KINDS = ("exception", "oom", "hang", "nan", "ckpt", "flake", "heal-source", "heal-joiner", "ps-push")


class NonFiniteError(AllhandsError):
    """Loss or gradients stayed NaN/Inf (or the policy is ``stop``)."""


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault; never caught by allhands."""


# What ProcessGroupGloo raises when a peer refuses the connection (its "Gloo connectFullMesh
# failed with " prefix, then gloo's own error); the injected marker says where it came from.
FLAKE_MESSAGE = ("Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc] Connection "
                 "refused (injected start-up flake {fault})")


@dataclass(frozen=True, order=True)
class Fault:
    step: int
    rank: int
    kind: str

    def __str__(self) -> str:
        return f"{self.rank}:{self.step}:{self.kind}"

    @property
    def signal(self) -> int | None:
        name = self.kind[len("launcher-"):] if self.to_launcher else self.kind
        return getattr(signal, name, None) if name.startswith("SIG") else None

    @property
    def to_launcher(self) -> bool:
        return self.kind.startswith("launcher-")


def parse_faults(spec: str) -> list[Fault]:
    """``"1:7:SIGKILL,0:12:hang"`` -> faults sorted by step. Raises ConfigError naming the entry."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        ok = len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() and int(parts[1]) >= 1
        kind = parts[2] if ok else ""
        if kind.startswith("slow="):
            factor = kind[len("slow="):]
            ok = ok and factor.replace(".", "", 1).isdigit() and float(factor) > 1
        elif kind.lower().startswith("launcher-"):
            kind = "launcher-" + kind[len("launcher-"):].upper()
            ok = ok and kind[len("launcher-"):] in {s.name for s in STOP_SIGNALS} | {"SIGKILL"}
        elif kind.upper().startswith("SIG"):
            kind = kind.upper()
            ok = isinstance(getattr(signal, kind, None), signal.Signals)
        elif ok:
            ok = kind in KINDS
        if not ok:
            raise ConfigError(f"fault.inject: {item!r} is not RANK:STEP:KIND with STEP >= 1 and KIND "
                              f"a signal name (SIGKILL, SIGTERM, ...), launcher-SIGINT|SIGTERM|SIGUSR1|SIGKILL, slow=F "
                              f"with F > 1, or one of "
                              f"{', '.join(KINDS)}")
        out.append(Fault(int(parts[1]), int(parts[0]), kind))
    return sorted(out)


def plan_faults(seed: int, n: int, *, steps: int, world_size: int, ckpt_interval: int) -> list[Fault]:
    """``n`` seeded faults at distinct steps in ``[2, steps - 1]``, each a SIGKILL of a random
    rank; every third one (when checkpoints are periodic) kills during a checkpoint write
    instead, at a checkpoint step. Same arguments, same plan: a drill can be replayed."""
    rng = random.Random(seed)
    candidates = list(range(2, steps))
    if n > len(candidates):
        raise ConfigError(f"--faults: {n} faults need at least {n + 2} steps; run.steps is {steps}")
    picked = sorted(rng.sample(candidates, n))
    plan = []
    ckpt_steps = [s for s in candidates if ckpt_interval and s % ckpt_interval == 0]
    for i, step in enumerate(picked):
        rank = rng.randrange(world_size)
        kind = "SIGKILL"
        if i % 3 == 1 and ckpt_steps:
            free = [s for s in ckpt_steps if s not in {f.step for f in plan} and s not in picked[i + 1:]]
            if free:
                step, kind = rng.choice(free), "ckpt"
        plan.append(Fault(step, rank, kind))
    return sorted(plan)


def fired_at(run_dir: Path) -> dict[str, float]:
    """Markers of the faults that fired in a run: ``{"RANK:STEP:KIND": unix time}``."""
    out = {}
    for p in sorted((run_dir / "faults").glob("*")):
        rank, step, kind = p.name.split("-", 2)
        out[f"{rank}:{step}:{kind}"] = float(p.read_text() or 0)
    return out


class FaultInjector:
    """This rank's share of a fault spec, with fire-once markers in the run directory."""

    def __init__(self, spec: str, rank: int, run_dir: Path):
        self.rank = rank
        self.marker_dir = run_dir / "faults"
        mine = [f for f in parse_faults(spec) if f.rank == rank]
        self.faults = [f for f in mine if not f.kind.startswith("slow=")]
        self.slow = [(f.step, float(f.kind[len("slow="):])) for f in mine if f.kind.startswith("slow=")]
        self._work_from: float | None = None  # when this rank's current step's work began
        self._started = False  # before_step was called in this process (a ``flake`` is at start)

    def _take(self, step: int, kinds: tuple[str, ...] | None, at_or_after: bool = False) -> Fault | None:
        for f in self.faults:
            hit = step >= f.step if at_or_after else step == f.step
            if hit and (kinds is None or f.kind in kinds) and (kinds is not None or f.kind not in KINDS):
                marker = self.marker_dir / f"{f.rank}-{f.step}-{f.kind}"
                if marker.exists():
                    continue
                self.marker_dir.mkdir(parents=True, exist_ok=True)
                with open(marker, "w") as fh:
                    fh.write(repr(time.time()))
                    fh.flush()
                    os.fsync(fh.fileno())
                return f
        return None

    def before_step(self, step: int) -> None:
        if self.slow:
            self._straggle(step)
        first, self._started = not self._started, True
        f = self._take(step, ("flake",), at_or_after=True) if self.faults and first else None
        if f is not None:
            raise RuntimeError(FLAKE_MESSAGE.format(fault=f))
        if self.faults and self._take(step, ("hang",)):
            while True:  # a hung rank: only the watchdog's SIGKILL ends this
                time.sleep(3600)

    def _straggle(self, step: int) -> None:
        now = time.perf_counter()
        factor = max((f for s, f in self.slow if step > s), default=1.0)  # the work of step - 1
        if self._work_from is not None and factor > 1:
            time.sleep((factor - 1) * (now - self._work_from))
        self._work_from = time.perf_counter()

    def after_forward(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Called once per step with the first micro-batch's loss."""
        if not self.faults:
            return loss
        f = self._take(step, ("exception", "oom")) or self._take(step, None)
        if f is not None and f.signal is not None:
            os.kill((worker_env().launcher_pid or os.getppid()) if f.to_launcher else os.getpid(), f.signal)
            # A stop signal comes back (forwarded) or is handled here: the step goes on and the
            # job stops after it. Another signal's default action may take a moment.
            # A killed launcher's workers get SIGINT as its forkserver ends (forkstart.py): a stop.
            FLAG.wait(60) if f.signal in STOP_SIGNALS or f.to_launcher else time.sleep(60)
        elif f is not None and f.kind == "oom":
            raise torch.OutOfMemoryError(f"injected out-of-memory at step {step} ({f})")
        elif f is not None:
            raise InjectedFault(f"injected exception at step {step} ({f})")
        if self._take(step, ("nan",)):
            return loss * math.nan
        return loss

    def ckpt_writer_hook(self, step: int):
        """A callable for the storage writer to run after this rank's files are written, or None."""
        return self._kill_hook(step, "ckpt")

    def heal_hook(self, step: int, source: bool):
        """A callable for a replica-mode heal to ``step`` to run halfway through its broadcast
        (in its ``source``, or in a member that is behind), or None."""
        return self._kill_hook(step, "heal-source" if source else "heal-joiner")

    def push_hook(self, step: int):
        """A callable that SIGKILLs this parameter-server worker partway through step ``step``'s
        push, or None. Taken (its marker written) here: the caller cuts the push short only then."""
        if not self.faults or self._take(step, ("ps-push",), at_or_after=True) is None:
            return None
        return lambda: os.kill(os.getpid(), signal.SIGKILL)

    def _kill_hook(self, step: int, kind: str):
        """A callable that SIGKILLs this process if a ``kind`` fault is due at ``step`` (at or
        after its STEP, once), or None when none can be."""
        if not self.faults or not any(f.kind == kind and step >= f.step for f in self.faults):
            return None

        def kill_now() -> None:
            if self._take(step, (kind,), at_or_after=True):
                os.kill(os.getpid(), signal.SIGKILL)
        return kill_now


class NonFiniteGuard:
    """Decides what a step with a NaN/Inf loss or gradient norm does.

    ``skip``: drop the update (the batch is consumed, the schedule advances, so the data order of
    later steps is unchanged); ``rollback``: reload the last committed checkpoint; ``stop``: fail.
    Any policy stops after ``max_in_row`` bad steps in a row: a run that keeps producing NaN is
    diverged, and skipping forever would only burn compute.
    """

    def __init__(self, policy: str, max_in_row: int):
        self.policy, self.max_in_row = policy, max_in_row
        self.in_row = 0

    def check(self, finite: bool, step: int, what: str = "loss or gradient") -> str:
        """'ok', 'skip' or 'rollback'; raises NonFiniteError for stop or too many in a row."""
        if finite:
            self.in_row = 0
            return "ok"
        self.in_row += 1
        if self.policy == "stop":
            raise NonFiniteError(f"non-finite {what} at step {step} (fault.nonfinite=stop); lower "
                                 f"optim.lr or set fault.nonfinite=skip/rollback")
        if self.in_row >= self.max_in_row:
            raise NonFiniteError(f"non-finite {what} in {self.in_row} steps in a row up to step {step} "
                                 f"(fault.max_nonfinite={self.max_in_row}); the run diverged: lower "
                                 f"optim.lr or resume from an earlier checkpoint")
        return self.policy

    def check_window(self, longest: int, where: str, last: int) -> None:
        """The verdict on steps already skipped on the device (agree.py): raises as
        :meth:`check` would have at the bad step (``stop``, or ``longest`` bad steps in a row
        reaching ``max_in_row``); ``where`` names the bad steps."""
        if self.policy == "stop":
            raise NonFiniteError(f"non-finite loss or gradient at {where} (fault.nonfinite=stop); "
                                 f"lower optim.lr or set fault.nonfinite=skip/rollback")
        if longest >= self.max_in_row:
            raise NonFiniteError(f"non-finite loss or gradient in {longest} steps in a row up to step "
                                 f"{last} (fault.max_nonfinite={self.max_in_row}); the run diverged: "
                                 f"lower optim.lr or resume from an earlier checkpoint")
