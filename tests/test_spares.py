"""Replica mode's roster, spares and failure notice (replica/spares.py, launch/replicas.py): claims
and hand-overs on a real store, a survivor that closes its quorum on the launcher's notice instead
of after the timeout, a bounded store, the heartbeat while waiting, a spare that replaces a
SIGKILLed group, a stop signal to the replicas launcher, and the drill in replica mode."""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from allhands.authstore import MACStore, store_key

from allhands.checkpoint import committed
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.replica import spares
from allhands.replica.quorum import QuorumStopped, ReplicaQuorum

from conftest import ALLHANDS, ROOT, TINY, tiny_config
from test_parity import max_rel_diff, reference_params
from test_replica import _in_threads, _quorum, _store, saved


def _client(master):
    """A process's MAC'd client of the job's store."""
    tcp = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    return MACStore(tcp, store_key("test-secret"), "test store")


def test_claims_spares_and_hand_over():
    master = _store()
    s = _client(master)
    assert spares.claim(s, "a", 0, 2) == 0 and spares.claim(s, "b", 1, 2) == 1
    assert spares.claim(s, "c", 2, 2) is None  # a spare slot, and no group is free
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("g", spares.wait_as_spare(s, "c")))
    t.start()
    time.sleep(0.1)
    assert spares.claim(s, "b2", 1, 2) is None  # b's restart while b is alive: nothing to take
    assert spares.hand_over(s, 1, "b", ["a", "b2", "c"]) == "c"  # a and b2 wait as no spare
    t.join(60)
    assert got["g"] == (1, True) and spares.holder(s, 1) == "c" and spares.is_dead(s, "b")
    # no spare left: the notice alone, and a restart takes the dead holder's group
    assert spares.hand_over(s, 1, "c", []) is None and spares.is_dead(s, "c")
    assert spares.claim(s, "c2", 2, 2) == 1 and spares.holder(s, 1) == "c2"
    assert spares.wait_as_spare(s, "d", stop=lambda: "done") == "done"


def test_the_failure_notice_closes_the_quorum_without_the_timeout():
    master = _store()
    # A quorum timeout no test run reaches: only the notice can close a quorum without group 1.
    a, b = _quorum(master, 0, timeout_s=3600), _quorum(master, 1, timeout_s=3600)
    _in_threads(lambda: a.form(0), lambda: b.form(0))
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("q", a.form(1)), daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # group 1 is alive as far as anyone knows: wait for it
    spares.hand_over(a.store, 1, b.life, [])  # its process died: the launcher's notice
    t.join(120)
    assert not t.is_alive(), "the notice did not close the quorum"
    assert out["q"].members == (0,)


def test_a_member_dead_between_the_decision_and_the_connection_is_a_failed_quorum(capfd):
    """form()'s window: group 1 registered for quorum 1, which was decided with it, and died before
    its gloo group connected. The survivor neither raises (its worker would restart) nor waits for
    the connection's timeout: on the launcher's notice every member agrees the quorum failed
    (before any gloo connection), and it re-forms without the dead group."""
    master = _store()
    # A quorum timeout no test run reaches: only the notice can fail the quorum and re-form it.
    a, b = _quorum(master, 0, timeout_s=3600), _quorum(master, 1, timeout_s=3600)
    b.store.set("q/1/m/1", f"0:{b.life}")  # group 1's registration; it never gets further
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("q", a.form(0)), daemon=True)
    t.start()
    while not master.check(["q/1/members"]):  # decided with both groups
        time.sleep(0.005)
    spares.hand_over(b.store, 1, b.life, [])  # its process died: the launcher's notice
    t.join(120)
    assert not t.is_alive(), "the notice did not fail the quorum"
    assert out["q"].members == (0,) and out["q"].qid == 2 and a.store.get("q/1/go") == b"no"
    assert "quorum 1 lost a member before its group connected" in capfd.readouterr().err
    g = [torch.full((2,), 3.0)]
    assert a.allreduce(g, 0) and torch.equal(g[0], torch.full((2,), 3.0))


def test_a_connection_that_fails_after_the_go_is_a_failed_quorum(capfd):
    """The rest of the window: group 1 said it was ready to connect, then never connected and no
    notice came (cut off). The survivor's gloo connection times out; that fails the quorum, and the
    survivor re-forms alone after quorum_timeout_s instead of raising."""
    master = _store()
    tcp = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=1))
    a = ReplicaQuorum(MACStore(tcp, store_key("test-secret"), "test store"), 0, 2, timeout_s=0.3,
                      dead_s=30.0, pg_timeout_s=1)
    b = _client(master)
    b.set("life/1", "b-life")
    b.set("q/1/m/1", "0:b-life")
    b.set("q/1/r/1.0", "1")  # ready to connect; then silence
    q = a.form(0)
    assert q.members == (0,) and q.qid == 2 and a.store.get("q/1/go") == b"yes"
    assert "quorum 1's group did not connect" in capfd.readouterr().err


def test_the_store_stays_bounded_and_a_waiting_group_beats():
    master = _store()
    a, b = _quorum(master, 0), _quorum(master, 1)
    _in_threads(lambda: a.form(0), lambda: b.form(0))
    counts = []
    for step in range(40):
        _in_threads(lambda: a.allreduce([torch.ones(2)], step), lambda: b.allreduce([torch.ones(2)], step))
        counts.append(master.num_keys())
    assert counts[-1] == counts[5], counts  # no key per step
    # a member waiting for a quorum (min_groups=2, its peer gone) keeps its heartbeat going and
    # leaves on a stop
    lone = _quorum(master, 0, timeout_s=0.05)
    lone.min_groups = 2
    beats = []

    def stop():
        lone.store.set("stop", str(int(signal.SIGTERM)))

    def beat():  # the stop comes after its second beat (or, without beats, after 120 s)
        beats.append(time.monotonic())
        if len(beats) == 2:
            stop()

    stopper = threading.Timer(120, stop)
    stopper.start()
    try:
        lone.form(40, on_wait=beat)
        raise AssertionError("form returned without a quorum")
    except QuorumStopped as e:
        assert e.signum == signal.SIGTERM
    finally:
        stopper.cancel()
    assert len(beats) == 2, beats


def _events(run: Path) -> list[dict]:
    path = run / "quorums.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.serial  # times the survivor's wait for the spare against fault.quorum_timeout_s
def test_a_spare_takes_the_place_of_a_killed_group(token_dir, tmp_path, capfd):
    cfg = tiny_config(token_dir, tmp_path / "run", "run.steps=8", "fault.mode=replica", "fault.spares=1",
                      "fault.max_restarts=1", "fault.inject=1:4:SIGKILL", "parallel.timeout_s=30",
                      "fault.quorum_timeout_s=5", "fault.min_groups=2")
    done = train_job(cfg, LaunchSpec(nproc=2))
    err = capfd.readouterr().err
    run = Path(done.run.dir)
    g0, g1 = _events(run), _events(run / "replicas" / "group-1")
    took = [line for line in err.splitlines() if "died; spare pid" in line]
    assert len(took) == 1, err[-3000:]
    spare_pid = int(took[0].split("spare pid ")[1].split()[0])
    assert len({e["pid"] for e in g0}) == 1  # the survivor never restarted
    assert g1[0]["pid"] != spare_pid and g1[-1]["pid"] == spare_pid and g1[-1]["from_group"] == 0
    # the survivor did not wait fault.quorum_timeout_s (5 s) for anyone
    assert all(e["seconds"] < 4 for e in g0[1:]), g0
    a, b = saved(run), saved(run / "replicas" / "group-1")
    assert int(a["train.step"]) == int(b["train.step"]) == 8
    for k in (k for k in a if k.startswith("model.")):
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k
    ref = reference_params(done, shares=2)
    got = {k.removeprefix("model.model."): v for k, v in a.items() if k.startswith("model.model.")}
    assert max_rel_diff(got, ref) <= 1e-5, max_rel_diff(got, ref)


def test_sigterm_to_the_replicas_launcher_stops_every_group_at_one_step(token_dir, tmp_path, cli_env):
    run = tmp_path / "run"
    sets = [f"--set={s}" for s in (*TINY, "run.steps=400", "fault.mode=replica", "checkpoint.interval=0",
                                   f"data.path={token_dir}", f"run.dir={run}", "log.progress=false")]
    proc = subprocess.Popen([*ALLHANDS, "train", "--nproc", "2", *sets], env=cli_env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    both = [run / "metrics.jsonl", run / "replicas" / "group-1" / "metrics.jsonl"]
    while not all(m.exists() and '"loss"' in m.read_text() for m in both):  # both are training
        assert proc.poll() is None and time.monotonic() < deadline, \
            (proc.kill(), proc.communicate(timeout=60))  # killed first: past the deadline it still runs
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    lines = [x for x in err.splitlines() if "stopped by SIGTERM" in x]
    assert len(lines) == 1 and "resume with: allhands train --nproc 2" in lines[0], err[-3000:]
    found = [committed(d / "checkpoints") for d in (run, run / "replicas" / "group-1")]
    assert all(found) and found[0][-1][0] == found[1][-1][0], (found, err[-3000:])


def test_drill_in_replica_mode(token_dir, tmp_path, cli_env):
    sets = [f"--set={s}" for s in (*TINY, "run.steps=6", "checkpoint.interval=2", "fault.mode=replica",
                                   "fault.spares=1", "fault.min_groups=2",  # both train, whenever each starts
                                   f"data.path={token_dir}", f"run.dir={tmp_path / 'drill'}")]
    r = subprocess.run([*ALLHANDS, "drill", "--nproc", "2", "--faults", "1", "--seed", "4", *sets],
                       capture_output=True, text=True, env=cli_env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert out[1].split() == ["fault", "(group:step:kind)", "stall", "s", "heal", "s", "back", "s",
                              "members", "equal"], out
    fault, stall, heal, back, equal = out[2].split()
    assert fault == out[0].split("fault.inject=")[1] and float(stall) >= 0 and float(heal) >= 0
    assert equal == "yes" and "goodput" in out[3], out
