"""The restart policy of a job: what to do about a failed attempt (restart, retry a start-up flake
without counting it, or stop), how long to wait, the one line that says so and its record in
``RUN_DIR/logs/restarts.jsonl``; one object per job, used by both restart paths.

Single node, the supervisor (supervisor.py) restarts each attempt of torch's elastic launch
itself; multi-node, torch's agent restarts and our subclass (elastic.SupervisedAgent) asks here
first. Both drive the same object the same way::

    job = policy.for_job(run_dir, node=None)   # node: the agent's label, multi-node only
    d = job.decide(summary, progressed, hangs)  # Decision; counts it, fixes the backoff
    if d.stops:                                 # 'fatal' or 'give_up'
        raise LaunchError(job.stop(d))          # writes the record, returns the final line
    job.backoff(d)                              # waits d.delay_s, writes the record, says the line
    ...                                         # the caller starts the next attempt

:class:`RestartPolicy` holds the settings (from ``fault.*`` and ``--max-restarts``) and the rule
(:meth:`RestartPolicy.decide`, without state, so one policy serves any number of jobs);
:class:`JobRestarts` holds what one job has used up. The clock, sleep and output are
injectable, so that the policy is tested without processes or waiting (tests/test_policy.py).
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

from allhands.checkpoint import committed
from allhands.config import FaultConfig
from allhands.errors import LaunchError

# Worker failures whose cause repeats on every restart: restarting would only burn the budget.
FATAL_CAUSES = ("ConfigError:", "CheckpointError:", "DataError:", "NonFiniteError:",
                "IntrusionError:")  # a forged store record repeats on every restart
# Start-up failures of a fresh rendezvous that a second try clears: with torch 2.13 a restart
# failed once in connectFullMesh and the next try worked.
TRANSIENT_CAUSES = ("connectFullMesh", "Connection refused", "RendezvousTimeoutError")
MAX_FLAKE_RETRIES = 2
# A flake is a race in a fresh rendezvous, not a crash loop: a short fixed wait, no backoff.
FLAKE_DELAY_S = 1.0
# Causes that are the machine's or the network's doing, never a bug of the job: a death by signal
# or exit code, a hang, a lost peer or node, a communication error or timeout. Any other cause is
# an exception a worker raised, and one that comes back word for word after a restart from the
# same checkpoint is the job's own bug: every further restart would replay the same steps from the
# same state into it ("repeated"). A job that committed a newer checkpoint in between is making
# progress and keeps its restarts.
NOT_A_BUG = ("killed by", "exited with code", " died", " hung: ", "lost node", "gloo", "nccl",
             "connect", "timed out", "timeout", *(c.lower() for c in TRANSIENT_CAUSES))
_PIDS = re.compile(r" \(pids? [\d, ]+\)")


def bug_signature(summary: str) -> str | None:
    """The first cause of ``summary`` (the failure the others followed, describe_failures) without
    its pid when it is an exception a worker raised (see NOT_A_BUG), else None: the key under which
    two attempts failed the same way."""
    first = summary.split("; worker rank")[0]
    if any(c in first.lower() for c in NOT_A_BUG):
        return None
    return _PIDS.sub("", first)


class WorkerFailure(LaunchError):
    """One attempt of the job failed; ``summary`` names the ranks and causes in one line."""

    def __init__(self, summary: str):
        super().__init__(summary)
        self.summary = summary


def say(msg: str) -> None:
    """One line to the launcher's stderr, at once (workers' output interleaves with it)."""
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RestartPolicy:
    # 0 here (a policy built by hand restarts nothing unless asked); ``allhands train`` and
    # ``allhands launch SCRIPT`` both default to fault.max_restarts (3) (launcher.py).
    max_restarts: int = 0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    hang_timeout_s: float = 0.0
    first_step_timeout_s: float = FaultConfig.first_step_timeout_s

    def delay(self, restart: int) -> float:
        """Seconds to wait before restart number ``restart`` (1-based): doubling, capped."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, restart - 1))

    def decide(self, summary: str, restarts_done: int, flakes: int, progressed: bool,
               previous: str = "") -> str:
        """'fatal', 'flake' (retry, not counted), 'repeated' (the same exception as the failed
        attempt before, ``previous``: a bug), 'restart' or 'give_up'."""
        if any(c in summary for c in FATAL_CAUSES):
            return "fatal"
        if not progressed and flakes < MAX_FLAKE_RETRIES and any(c in summary for c in TRANSIENT_CAUSES):
            return "flake"
        bug = bug_signature(summary)
        if restarts_done < self.max_restarts and bug is not None and bug == bug_signature(previous):
            return "repeated"
        return "restart" if restarts_done < self.max_restarts else "give_up"

    def describe(self, multi_node: bool = False) -> str:
        """The start-up line that says what happens when a worker fails."""
        if self.max_restarts == 0:
            return ("allhands: recovery: off (fault.max_restarts=0): a failed worker ends the job; "
                    "--max-restarts N restarts it from the last checkpoint")
        every = " (all nodes re-rendezvous)" if multi_node else ""
        return (f"allhands: recovery: up to {self.max_restarts} restart(s) from the last checkpoint"
                f"{every} (fault.max_restarts, --max-restarts N)")

    def for_job(self, run_dir: Path | None, node: str | None = None, **io) -> "JobRestarts":
        """A fresh account of restarts for one job (see :class:`JobRestarts` for ``io``)."""
        return JobRestarts(self, run_dir, node, **io)


@dataclass(frozen=True)
class Decision:
    """What :meth:`JobRestarts.decide` made of one failed attempt."""

    verdict: str  # restart | flake | fatal | repeated | give_up | admit (a node joins; not a failure)
    summary: str  # the failure in one line, the watchdog's hang reports first
    attempt: int  # which attempt of this job failed, from 0
    failed_at: float
    hang: bool = False  # the watchdog killed a hung worker
    delay_s: float = 0.0  # wait before the next attempt; 0 when it stops
    what: str = ""  # 'restart k/N' or 'start-up flake, retry i/M (not counted)'

    @property
    def stops(self) -> bool:
        return self.verdict in ("fatal", "repeated", "give_up")


class JobRestarts:
    """One job's restarts under ``policy``: counters, backoff, record and lines.

    ``run_dir`` None: a script launched by ``allhands launch`` owns its run directory, and nothing
    is recorded. ``node``: the agent's label of this node in a multi-node job; it goes into the
    records, and the lines say that all nodes re-rendezvous and how to continue after a stop.
    ``checkpoints``: where the next attempt resumes from, when not ``run_dir/checkpoints`` (a
    parameter-server world in replica mode logs in a directory of its own but resumes from the
    servers' or its worker group's checkpoints, launch/psgroups.py). ``resume_dir``: the run
    directory that ``--resume`` takes, when not ``run_dir`` (such a world, or a replica group
    other than 0, logs in a directory inside the run's)."""

    def __init__(self, policy: RestartPolicy, run_dir: Path | None, node: str | None = None, *,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 say: Callable[[str], None] = say, checkpoints: Path | None = None,
                 resume_dir: Path | None = None):
        self.policy, self.run_dir, self.node = policy, run_dir, node
        self.resume_dir = resume_dir or run_dir
        self.checkpoints = checkpoints or (run_dir / "checkpoints" if run_dir is not None else None)
        self.clock, self.sleep, self.say = clock, sleep, say
        # restarts: counted against max_restarts; flakes: retries since the last restart;
        # stalled: restarts in a row whose attempt completed no step (the backoff's exponent).
        self.restarts = self.flakes = self.stalled = self.attempts = 0
        # the last failure's summary and where it restarted from (a repeated bug stops the job)
        self.previous, self.previous_from = "", ""

    def decide(self, summary: str, progressed: bool, hangs: Iterable[str] = ()) -> Decision:
        """Judge a failed attempt and count it. ``progressed``: it completed a step; ``hangs``:
        the watchdog's reports of the workers it killed, which lead the summary."""
        hangs = list(hangs)
        summary = "; ".join([*hangs, summary])
        # The same point: no newer checkpoint since the last failure; a script's run directory is
        # its own, so there an attempt that completed no step stands for it.
        point = self.resume_from() if self.run_dir is not None else "" if progressed else "no step"
        same = self.previous if point and point == self.previous_from else ""
        d = Decision(self.policy.decide(summary, self.restarts, self.flakes, progressed, same),
                     summary, self.attempts, self.clock(), bool(hangs))
        self.attempts += 1
        self.previous, self.previous_from = summary, point
        if d.verdict == "flake":
            self.flakes += 1
            return replace(d, delay_s=FLAKE_DELAY_S,
                           what=f"start-up flake, retry {self.flakes}/{MAX_FLAKE_RETRIES} (not counted)")
        if d.verdict == "restart":
            # The backoff doubles while attempts fail before completing a step, and starts over
            # once one made progress: a fault every few hours is not a crash loop.
            self.restarts += 1
            self.flakes = 0
            self.stalled = 0 if progressed else self.stalled + 1
            return replace(d, delay_s=self.policy.delay(max(1, self.stalled)),
                           what=f"restart {self.restarts}/{self.policy.max_restarts}")
        return d

    def backoff(self, d: Decision) -> None:
        """Before the next attempt: wait ``d.delay_s``, then record it and say the line. A stop
        during the wait (stop.Stopped, raised by the signal handler) still records the failure,
        marked with the stop, so no failure is missing from restarts.jsonl."""
        try:
            self.sleep(d.delay_s)
        except BaseException as e:
            self.record(d, delay_s=d.delay_s, resume_from=self.resume_from(),
                        stopped=str(e) or type(e).__name__)
            raise
        # Read after the backoff: a worker that raised gives its save in flight time to commit
        # (Checkpointer.drain), which may land just after the failure is reported.
        resume = self.resume_from()
        self.record(d, delay_s=d.delay_s, resume_from=resume)
        where = " (re-rendezvous of all nodes)" if self.node is not None else ""
        self.say(f"allhands: {d.summary}; {d.what} from {resume} after {d.delay_s:.1f} s{where}")

    def stop(self, d: Decision) -> str:
        """The job ends with ``d``: record it and return the one line to end with."""
        resume = self.resume_from()
        self.record(d, resume_from=resume)
        if d.verdict == "fatal":  # its own message names the fix
            return d.summary
        if self.node is not None:
            again = "continue by starting the job again on every node"
        elif self.run_dir is None:
            again = "continue by starting the script again"
        else:
            again = f"continue from {resume} with --resume {self.resume_dir}"
        if d.verdict == "repeated":
            return (f"{d.summary}; the same error as the attempt before, so a bug to fix rather "
                    f"than a fault to restart: fix it, then {again}")
        if self.policy.max_restarts == 0:
            return f"{d.summary}; restarts are off (fault.max_restarts=0): {again}, or pass --max-restarts N"
        return (f"{d.summary}; gave up after {self.restarts} restart(s) "
                f"(fault.max_restarts={self.policy.max_restarts}): {again}, or allow more "
                f"with --max-restarts N")

    def admit(self) -> None:
        """A node waits to join, so torch restarts every worker to admit it: not a failure and
        not counted, but a membership change, so it is recorded and said like one (a forged
        rendezvous state must never restart workers silently)."""
        d = Decision("admit", "a node is waiting to join", self.attempts, self.clock())
        resume = self.resume_from()
        self.record(d, resume_from=resume)
        self.say(f"allhands: a node is waiting to join; node {self.node} restarts its workers to "
                 f"admit it from {resume} (not counted as a restart)")

    def resume_from(self) -> str:
        """Where the next attempt starts, in words (``allhands drill`` reads the step back)."""
        if self.run_dir is None:
            return "the script's last committed checkpoint"
        found = committed(self.checkpoints)
        return f"checkpoint step {found[-1][0]}" if found else "the start (no committed checkpoint yet)"

    def record(self, d: Decision, **extra) -> None:
        """One line per failure in RUN_DIR/logs/restarts.jsonl (read by ``allhands drill``)."""
        if self.run_dir is None:
            return
        rec = {"attempt": d.attempt, "failed_at": d.failed_at, "summary": d.summary,
               "verdict": d.verdict, "hang": d.hang,
               **({"node": self.node} if self.node is not None else {}), **extra}
        path = self.run_dir / "logs" / "restarts.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
