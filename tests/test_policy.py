"""The restart policy of a job (launch/policy.py) without processes: verdicts, counters, backoff,
the lines it says and the records it writes, with a fake clock and sleep so that nothing waits."""

from __future__ import annotations

import json
import signal

import pytest

from allhands.config import Config, apply_override
from allhands.launch.launcher import LaunchSpec, restart_policy, script_policy
from allhands.launch.policy import (FATAL_CAUSES, MAX_FLAKE_RETRIES, JobRestarts, RestartPolicy,
                                    bug_signature)
from allhands.launch.stop import Stopped

KILLED = "worker rank 1 (pid 9) on node a failed: killed by SIGKILL"
FLAKE = "worker rank 1 (pid 9) on node a failed: RuntimeError: Gloo connectFullMesh failed with [pair.cc:144]"


class Clock:
    """time.time and time.sleep for a job: sleeping moves the clock, and ``during_sleep`` runs
    what would happen meanwhile (a checkpoint committing)."""

    def __init__(self):
        self.now, self.slept, self.lines, self.during_sleep = 1000.0, [], [], None

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s
        if self.during_sleep:
            self.during_sleep()

    def job(self, policy: RestartPolicy, run_dir=None, node=None) -> JobRestarts:
        return policy.for_job(run_dir, node, clock=lambda: self.now, sleep=self.sleep,
                              say=self.lines.append)


def records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "logs" / "restarts.jsonl").read_text().splitlines()]


def commit_checkpoint(run_dir, step: int) -> None:
    d = run_dir / "checkpoints" / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"")


@pytest.mark.parametrize("cause", FATAL_CAUSES)
def test_a_fatal_cause_stops_at_once_whatever_is_left(cause, tmp_path):
    c = Clock()
    job = c.job(RestartPolicy(max_restarts=5), tmp_path)
    summary = f"worker rank 0 (pid 1) on node a failed: {cause} bad"
    d = job.decide(summary, progressed=False)
    assert d.verdict == "fatal" and d.stops and d.delay_s == 0
    assert job.stop(d) == summary  # no "gave up": nothing was tried
    assert c.slept == [] and c.lines == [] and job.restarts == 0
    (rec,) = records(tmp_path)
    assert rec == {"attempt": 0, "failed_at": 1000.0, "summary": summary, "verdict": "fatal",
                   "hang": False, "resume_from": "the start (no committed checkpoint yet)"}


def test_a_flake_before_progress_is_retried_without_counting_up_to_the_limit():
    c = Clock()
    job = c.job(RestartPolicy(max_restarts=1, backoff_s=4))
    for i in range(1, MAX_FLAKE_RETRIES + 1):
        d = job.decide(FLAKE, progressed=False)
        assert (d.verdict, d.delay_s, job.restarts) == ("flake", 1.0, 0)
        job.backoff(d)
        assert c.lines[-1] == (f"allhands: {FLAKE}; start-up flake, retry {i}/{MAX_FLAKE_RETRIES} "
                               f"(not counted) from the script's last committed checkpoint after 1.0 s")
    d = job.decide(FLAKE, progressed=False)  # not forever: the next one counts
    assert (d.verdict, d.what, d.delay_s, job.restarts, job.flakes) == ("restart", "restart 1/1", 4, 1, 0)
    assert job.decide(FLAKE, progressed=False).verdict == "flake"  # the count starts over
    after = c.job(RestartPolicy(max_restarts=0)).decide(FLAKE, progressed=True)
    assert after.verdict == "give_up"  # once a step completed it is a real failure
    assert after.attempt == 0


@pytest.mark.parametrize("node", [None, "10.61.0.2"])
def test_restarts_count_to_the_limit_then_give_up_with_the_fix_for_the_path(node, tmp_path):
    c = Clock()
    job = c.job(RestartPolicy(max_restarts=2, backoff_s=0.5), tmp_path, node=node)
    for k in (1, 2):
        d = job.decide(KILLED, progressed=True)
        assert (d.verdict, d.what, d.attempt) == ("restart", f"restart {k}/2", k - 1)
        job.backoff(d)
    assert c.lines[0].startswith(f"allhands: {KILLED}; restart 1/2 from ")
    assert c.lines[0].endswith(" after 0.5 s (re-rendezvous of all nodes)" if node else " after 0.5 s")
    commit_checkpoint(tmp_path, 4)
    d = job.decide(KILLED, progressed=True)
    assert d.verdict == "give_up" and d.stops
    fix = ("continue by starting the job again on every node" if node
           else f"continue from checkpoint step 4 with --resume {tmp_path}")
    assert job.stop(d) == (f"{KILLED}; gave up after 2 restart(s) (fault.max_restarts=2): {fix}, "
                           f"or allow more with --max-restarts N")
    none_allowed = c.job(RestartPolicy(max_restarts=0), tmp_path, node=node)
    assert none_allowed.stop(none_allowed.decide(KILLED, True)) == (
        f"{KILLED}; restarts are off (fault.max_restarts=0): {fix}, or pass --max-restarts N")


def test_the_same_exception_after_a_restart_is_a_bug_and_stops_the_job(tmp_path):
    """A worker's own exception, word for word again after the restart from the same checkpoint
    (pids aside), would repeat on every restart: one restart, then stop with the fix."""
    bug = "worker rank 1 (pid {}) on node a failed: TypeError: forward() got an unexpected keyword 'mask'"
    c = Clock()
    job = c.job(RestartPolicy(max_restarts=3), tmp_path)
    first = job.decide(bug.format(11), progressed=False)
    assert first.verdict == "restart"  # once: it may have been a one-off
    job.backoff(first)
    d = job.decide(bug.format(12), progressed=False)
    assert d.verdict == "repeated" and d.stops and job.restarts == 1
    assert job.stop(d) == (f"{bug.format(12)}; the same error as the attempt before, so a bug to fix "
                           f"rather than a fault to restart: fix it, then continue from the start (no "
                           f"committed checkpoint yet) with --resume {tmp_path}")
    assert [r["verdict"] for r in records(tmp_path)] == ["restart", "repeated"]
    # A newer checkpoint in between: the job moves on, and keeps its restarts. A script's run
    # directory is its own: there, an attempt that completed a step moved on.
    moving = c.job(RestartPolicy(max_restarts=3), tmp_path / "moving")
    for step in (5, 10, 15):
        commit_checkpoint(tmp_path / "moving", step)
        assert moving.decide(bug.format(step), progressed=True).verdict == "restart"
    script = c.job(RestartPolicy(max_restarts=5))
    assert [script.decide(bug.format(1), progressed=p).verdict for p in (True, True, False, False)] == \
        ["restart", "restart", "restart", "repeated"]
    # The cause is the first failure: a peer's line that followed it does not hide it.
    peer = "; worker rank 0 (pid 3) on node a failed: its peer worker rank 1 failed first"
    assert bug_signature(bug.format(1) + peer) == bug_signature(bug.format(2)) is not None
    # Deaths, hangs, lost peers and communication errors are not bugs, however alike; another
    # exception is not the same bug.
    p = RestartPolicy(max_restarts=3)
    for same in (KILLED, "worker rank 0 (pid 3) on node a failed: its peer worker rank 1 died "
                         "(killed by SIGKILL)",
                 "worker rank 0 (pid 3) on node a failed: RuntimeError: [gloo] Timed out waiting 30000ms"):
        assert p.decide(same, 1, 0, True, previous=same) == "restart", same
    assert p.decide(bug.format(1), 1, 0, True, previous=bug.replace("mask", "bias").format(1)) == "restart"
    assert p.decide(bug.format(1), 3, 0, True, previous=bug.format(1)) == "give_up"  # none left


def test_recovery_is_on_by_default_and_the_start_up_line_says_so():
    default = restart_policy(Config(), LaunchSpec())
    assert default.max_restarts == Config().fault.max_restarts == 3
    assert default.describe() == ("allhands: recovery: up to 3 restart(s) from the last checkpoint "
                                  "(fault.max_restarts, --max-restarts N)")
    assert "all nodes re-rendezvous" in default.describe(multi_node=True)
    off = restart_policy(Config(), LaunchSpec(max_restarts=0)).describe()
    assert off.startswith("allhands: recovery: off (fault.max_restarts=0)") and "--max-restarts N" in off



def test_a_node_admitted_is_said_and_recorded_but_not_counted(tmp_path):
    """A node waiting to join restarts every worker (torch's agent): a membership change, so one
    line and a restarts.jsonl record with the verdict ``admit``, never silent, never counted."""
    c = Clock()
    job = c.job(RestartPolicy(max_restarts=1), run_dir=tmp_path, node="10.61.0.2")
    commit_checkpoint(tmp_path, 4)
    job.admit()
    assert c.lines == ["allhands: a node is waiting to join; node 10.61.0.2 restarts its workers "
                       "to admit it from checkpoint step 4 (not counted as a restart)"]
    (rec,) = records(tmp_path)
    assert (rec["verdict"], rec["node"], rec["resume_from"]) == ("admit", "10.61.0.2",
                                                                 "checkpoint step 4")
    assert job.restarts == 0 and job.decide(KILLED, progressed=True).verdict == "restart"

def test_a_stop_during_the_backoff_still_records_the_failure(tmp_path):
    """A launcher stopped while it waits to restart (a signal, or a replica slot ended because the
    job finished meanwhile) never restarts, but the failure is on record, marked with the stop."""
    c = Clock()

    def stopped():
        raise Stopped(signal.SIGTERM, clean=False)
    c.during_sleep = stopped
    commit_checkpoint(tmp_path, 2)
    job = c.job(RestartPolicy(max_restarts=1, backoff_s=4), tmp_path)
    d = job.decide(KILLED, progressed=True)
    with pytest.raises(Stopped):
        job.backoff(d)
    (rec,) = records(tmp_path)
    assert (rec["verdict"], rec["resume_from"], rec["stopped"]) == ("restart", "checkpoint step 2", "SIGTERM")
    assert c.lines == []  # no "restart 1/1 from ..." line: it did not restart


def test_the_backoff_doubles_while_stalled_resets_after_progress_and_is_capped():
    c = Clock()
    job = c.job(RestartPolicy(max_restarts=20, backoff_s=1, max_backoff_s=5))
    for progressed in (False, False, False, False, False, True, False, True, True):
        job.backoff(job.decide(KILLED, progressed))
    assert c.slept == [1, 2, 4, 5, 5, 1, 1, 1, 1]
    # A progressing attempt resets the exponent; the stalled one after it starts from the bottom.
    job.backoff(job.decide(KILLED, False))
    job.backoff(job.decide(KILLED, False))
    assert c.slept[-2:] == [1, 2]


@pytest.mark.parametrize("node", [None, "10.61.0.2"])
def test_the_record_reads_the_checkpoint_committed_during_the_backoff(node, tmp_path):
    c = Clock()
    job = c.job(RestartPolicy(max_restarts=3, backoff_s=2, hang_timeout_s=3), tmp_path, node)
    hang = "worker rank 0 (pid 7) on node a hung: no progress for 3.1 s after step 3"
    d = job.decide(KILLED, progressed=True, hangs=[hang])
    assert d.summary == f"{hang}; {KILLED}" and d.hang
    c.during_sleep = lambda: commit_checkpoint(tmp_path, 4)  # a save in flight lands meanwhile
    job.backoff(d)
    assert c.lines[-1].startswith(f"allhands: {hang}; {KILLED}; restart 1/3 from checkpoint step 4 after 2.0 s")
    c.during_sleep = None
    c.now = 2000.0
    job.stop(job.decide("worker rank 1 failed: DataError: gone", progressed=False))
    first, last = records(tmp_path)
    where = {"node": node} if node else {}
    assert first == {"attempt": 0, "failed_at": 1000.0, "summary": f"{hang}; {KILLED}",
                     "verdict": "restart", "hang": True, **where, "delay_s": 2,
                     "resume_from": "checkpoint step 4"}
    assert last == {"attempt": 1, "failed_at": 2000.0, "summary": "worker rank 1 failed: DataError: gone",
                    "verdict": "fatal", "hang": False, **where, "resume_from": "checkpoint step 4"}


def test_restart_policy_comes_from_the_config_and_the_command_line_wins():
    cfg = Config()
    for item in ("fault.max_restarts=3", "fault.backoff_s=0.25", "fault.hang_timeout_s=7"):
        apply_override(cfg, item)
    assert restart_policy(cfg, LaunchSpec()) == RestartPolicy(max_restarts=3, backoff_s=0.25,
                                                                hang_timeout_s=7)
    assert restart_policy(cfg, LaunchSpec(max_restarts=0)).max_restarts == 0
    assert restart_policy(cfg, LaunchSpec(max_restarts=5)).max_restarts == 5


def test_launch_and_train_share_one_restart_default():
    train = restart_policy(Config(), LaunchSpec())
    script = script_policy(LaunchSpec())
    assert script.max_restarts == train.max_restarts == Config().fault.max_restarts > 0
    assert script.backoff_s == train.backoff_s and script.hang_timeout_s == 0
    assert script_policy(LaunchSpec(max_restarts=0)).max_restarts == 0
