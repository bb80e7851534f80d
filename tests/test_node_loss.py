"""A whole host fails: every process of one lab host (the ``allhands train``
launcher, torch's agent in it and its workers) is SIGKILLed mid-training, after a committed
checkpoint. Either the host's command is started again (Slurm requeue, a Kubernetes restart) and
the job ends bit-identical to an undisturbed run, or it does not come back and the survivor
continues alone (``--nnodes 1:2``) on the same global batches, within float tolerance of the
single-process reference. Both survivors name the lost node and rank in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from allhands.checkpoint import committed
from allhands.config import load_config
from allhands.netlab import Lab, unavailable

from isolation import exclusive
from conftest import ALLHANDS, LAB_JOB, TINY
from test_parity import assert_matches_reference, trained_params

REASON = unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}"),
              pytest.mark.exclusive("netlab")]
TAG, PREFIX = "ahm", "10.61.0"

# The lab job (conftest.LAB_JOB). Rank 1 (the worker of host 1) stalls before step 5, so the kill
# lands mid-training after the step-4 checkpoint whatever the machine's speed; the marker
# fault.inject leaves in the shared run directory keeps a requeued rank 1 from stalling again.
JOB = LAB_JOB


@pytest.fixture(scope="module")
def lab():
    with exclusive("netlab"), Lab(2, tag=TAG, prefix=PREFIX) as lab:
        yield lab


def _start(lab, rank: int, nnodes: str, sets: list[str], env: dict, log):
    host = lab.hosts[rank]
    cmd = [*ALLHANDS, "train", "--nnodes", nnodes, "--node-rank", str(rank), "--nproc", "1",
           "--rdzv-endpoint", f"{lab.hosts[0].addr}:29400", "--local-addr", host.addr,
           *(x for s in sets for x in ("--set", s))]
    return host.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _kill_host_1(lab, token_dir, run_dir, cli_env, *, nnodes: str, requeue: bool):
    """Run the job on both lab hosts, SIGKILL host 1's whole session once step 4 is committed,
    optionally start its command again; returns node 0's output. A recovery that hangs fails on
    node 0's wait."""
    sets = [*TINY, *JOB, f"data.path={token_dir}", f"run.dir={run_dir}", "fault.inject=1:5:hang"]
    env = dict(cli_env, ALLHANDS_SECRET="lab-test-secret-" + "x" * 16, OMP_NUM_THREADS="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    logs = [open(run_dir.parent / f"node{r}.log", "w+") for r in (0, 1)]
    # Host 1 first: its agent dials the rendezvous until node 0 listens, so the two join
    # together and the --nnodes 1:2 job starts with both.
    p1 = _start(lab, 1, nnodes, sets, env, logs[1])
    time.sleep(1)
    p0 = _start(lab, 0, nnodes, sets, env, logs[0])
    deadline = time.monotonic() + 240
    while not any(step >= 4 for step, _ in committed(run_dir / "checkpoints")):
        assert p0.poll() is None and p1.poll() is None, "a node ended before the kill"
        assert time.monotonic() < deadline, "no checkpoint of step 4 in 240 s"
        time.sleep(0.2)
    os.killpg(p1.pid, signal.SIGKILL)  # launcher, torch's agent and the worker: one session
    p1.wait(timeout=60)
    if requeue:
        time.sleep(1)
        logs[1] = open(run_dir.parent / "node1-requeued.log", "w+")
        p1 = _start(lab, 1, nnodes, sets, env, logs[1])
    rc0 = p0.wait(timeout=240)
    out = [(log.seek(0), log.read())[1] for log in logs]
    assert rc0 == 0, out[0][-3000:]
    if requeue:
        assert p1.wait(timeout=60) == 0, out[1][-3000:]
        assert "rejoins it (a requeued node or job)" in out[1]
    return out[0]


def _assert_failure_named(out: str, run_dir) -> None:
    lines = [x for x in out.splitlines() if "restart 1/2" in x]
    assert len(lines) == 1, out[-3000:]
    line = lines[0]
    assert ("worker rank 0" in line and "on node 10.61.0.1 failed: lost node 10.61.0.2 (worker rank 1)"
            in line and "from checkpoint step 4" in line), line
    (event,) = [json.loads(x) for x in (run_dir / "logs" / "restarts.jsonl").read_text().splitlines()]
    assert event["node"] == "10.61.0.1" and event["verdict"] == "restart"


def test_a_killed_host_that_is_started_again_rejoins_bit_exact(lab, lab_undisturbed, token_dir, tmp_path,
                                                              cli_env):
    run_dir = tmp_path / "run"
    out = _kill_host_1(lab, token_dir, run_dir, cli_env, nnodes="2", requeue=True)
    _assert_failure_named(out, run_dir)
    assert "continuing on 2 node(s), world size 2" in out
    want = trained_params(lab_undisturbed)
    got = trained_params(load_config(run_dir / "config.resolved.toml"))
    assert all(torch.equal(got[k], want[k]) for k in want), "not bit-identical to the undisturbed run"


def test_a_killed_host_that_stays_down_leaves_the_survivor_training(lab, token_dir, tmp_path, cli_env):
    run_dir = tmp_path / "run"
    out = _kill_host_1(lab, token_dir, run_dir, cli_env, nnodes="1:2", requeue=False)
    _assert_failure_named(out, run_dir)
    assert_survivor_finished(out, run_dir, "node 10.61.0.2 (worker rank 1)", "2 hosts, then 1 after losing one")


def assert_survivor_finished(out: str, run_dir, lost: str, what: str) -> None:
    """The node ``lost`` left for good; the other went on alone from the step-4 checkpoint:
    steps 1-4 at world size 2, 5-8 at world size 1, on the same global batches as the
    single-process reference."""
    assert (f"{lost} left the job (no keep-alive for fault.node_timeout_s=3 s)" in out
            and "continuing on 1 node(s), world size 1" in out), out
    assert "resumed from step 4" in out
    assert_matches_reference(load_config(run_dir / "config.resolved.toml"), what)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [len(r["step_time_rank"]) for r in recs if r.get("step") == 8 and "loss" in r] == [1]


def test_multi_node_restart_limit_stops_every_node_with_one_line_each(lab, token_dir, tmp_path, cli_env):
    """Rank 0 (host 0) raises at steps 3 and 4; one restart is allowed: both nodes name each
    failure as it happens, restart once with backoff, then stop with exit 1 and a last line."""
    run_dir = tmp_path / "run"
    sets = [*TINY, *JOB, "run.steps=4", "fault.max_restarts=1", f"data.path={token_dir}",
            f"run.dir={run_dir}", "fault.inject=0:3:exception,0:4:exception"]
    env = dict(cli_env, ALLHANDS_SECRET="lab-test-secret-" + "x" * 16, OMP_NUM_THREADS="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    p1 = _start(lab, 1, "2", sets, env, subprocess.PIPE)
    time.sleep(1)
    p0 = _start(lab, 0, "2", sets, env, subprocess.PIPE)
    out0, out1 = p0.communicate(timeout=240)[0], p1.communicate(timeout=60)[0]
    assert (p0.returncode, p1.returncode) == (1, 1), out0[-2000:] + out1[-2000:]
    first = [x for x in out0.splitlines() if "restart 1/1" in x]
    assert len(first) == 1 and "worker rank 0" in first[0] and "on node 10.61.0.1 failed: " \
        "InjectedFault: injected exception at step 3" in first[0], out0[-2000:]
    last = out0.strip().splitlines()[-1]
    assert last.startswith("allhands: error: worker rank 0") and "step 4" in last and \
        "gave up after 1 restart(s) (fault.max_restarts=1)" in last, last
    # Node 1's worker only saw its peer vanish; its lines say which node that was.
    assert "failed: lost node 10.61.0.1 (worker rank 0): gloo: " in out1, out1[-2000:]
    assert "gave up after 1 restart(s)" in out1.strip().splitlines()[-1], out1[-3000:]
    events = [json.loads(x) for x in (run_dir / "logs" / "restarts.jsonl").read_text().splitlines()]
    assert sorted((e["node"], e["verdict"]) for e in events) == [
        ("10.61.0.1", "give_up"), ("10.61.0.1", "restart"), ("10.61.0.2", "give_up"), ("10.61.0.2", "restart")]
