"""The chaos drill's parts without processes: the invariant checker on hand-made runs (each rule
broken on purpose once), the seeded schedule, every world's restart log, a late replica group's
catch-up, a resume from another group's newer step, and the heartbeat kept while waiting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from allhands.chaos import check as chk
from allhands.chaos.run import KINDS, inject_spec, plan_chaos
from allhands.checkpoint.checkpointer import Checkpointer
from allhands.faults import parse_faults
from allhands.heartbeat import Heartbeat, read_heartbeats
from allhands.paths import restart_logs
from allhands.replica.start import catch_up


def good() -> chk.Record:
    """A restart-mode run of 10 steps, one kill at t=5 detected at 5.5, a step at 7."""
    return chk.Record(mode="restart", steps=10, exit_code=0, last_line="allhands: done",
                      final_steps={"job": 10}, commits=[(1, 2), (4, 4), (9, 10)],
                      restarts=[{"failed_at": 5.5, "world": "job", "verdict": "restart"}],
                      step_times={"job": [1, 2, 3, 4, 5, 7, 8, 9]}, fired=[chk.Fired("worker", 5.0)],
                      hang_timeout_s=3, params_equal=True, leftovers={"processes": []}, ended=40)


def verdicts(r: chk.Record) -> dict[str, bool]:
    return {row.rule: row.ok for row in chk.check(r)}


def test_the_checker_passes_a_clean_run_and_prints_one_table():
    rows = chk.check(good())
    assert all(r.ok for r in rows), chk.table(rows)
    text = chk.table(rows)
    assert text.splitlines()[0].split() == ["invariant", "ok", "detail"] and len(text.splitlines()) == 7


def test_the_checker_fails_each_invariant_broken_on_purpose():
    lost = good()
    lost.commits = [(1, 2), (4, 6), (6, 4), (9, 10)]  # a committed step lost
    assert verdicts(lost)["commits"] is False
    lost.torn = [6]  # unless that step was torn on purpose: the fallback is the rule
    assert verdicts(lost)["commits"] is True
    orphan = good()
    orphan.leftovers = {"processes": ["4242 python"], "shm": [], "tmp": ["pymp-x"]}
    row = next(r for r in chk.check(orphan) if r.rule == "leftovers")
    assert not row.ok and "4242 python" in row.detail and "pymp-x" in row.detail
    unrecorded = good()
    unrecorded.restarts = []
    assert verdicts(unrecorded)["faults"] is False
    silent = good()
    silent.step_times = {"job": [1, 2, 30]}  # 28 s without a line, limit 3 + 10
    assert verdicts(silent)["silence"] is False
    silent.relaunched = [20]  # the runner resumed a killed launcher's job meanwhile: no ranks ran
    assert verdicts(silent)["silence"] is True
    differ = good()
    differ.params_equal = False
    assert verdicts(differ)["parameters"] is False
    short = good()
    short.final_steps = {"job": 10, "group-1": 4}
    assert verdicts(short)["ends"] is False
    gave_up = good()
    gave_up.exit_code, gave_up.last_line, gave_up.params_equal = 1, "allhands: error: x; gave up", None
    assert verdicts(gave_up)["ends"] is False
    gave_up.last_line += "; continue from checkpoint step 4 with --resume RUN"
    assert verdicts(gave_up)["ends"] is True


def test_the_checker_finds_a_job_process_by_its_tag():
    env = {**os.environ, "ALLHANDS_CHAOS_TAG": "t-123"}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        time.sleep(0.3)
        assert any(e.startswith(f"{p.pid} ") for e in chk.tagged_processes("t-123"))
        assert not chk.tagged_processes("t-other")
    finally:
        p.kill()
        p.wait(timeout=60)
    assert not chk.tagged_processes("t-123")


def test_the_chaos_plan_is_seeded_and_covers_every_kind_of_its_mode():
    for mode, workers, servers in (("restart", 2, 0), ("replica", 2, 0), ("ps", 2, 1)):
        a = plan_chaos(7, 60, mode=mode, steps=40, workers=workers, servers=servers)
        assert a == plan_chaos(7, 60, mode=mode, steps=40, workers=workers, servers=servers)
        assert a != plan_chaos(8, 60, mode=mode, steps=40, workers=workers, servers=servers)
        assert {p.kind for p in a} == set(KINDS[mode]) or len(a) < len(KINDS[mode])
        assert len({p.step for p in a}) == len(a) == 6
        for f in parse_faults(inject_spec(a)):  # the injector's share is a valid spec
            assert f.rank < workers + servers
            assert (f.rank >= workers) == any(p.kind.startswith("server-") and p.step == f.step for p in a)


def _commit(ckpt_dir: Path, step: int, value: float) -> Path:
    """A real committed checkpoint of a tiny state (one tensor filled with ``value``), written by
    allhands' Checkpointer as a job writes its own (DCP files, allhands.json, manifest)."""
    ck = Checkpointer(ckpt_dir, rank=0, keep_last=3, mode="sync")
    try:
        ck.save(step, {"w": torch.full((4,), float(value))})
    finally:
        ck.close()
    return ckpt_dir / f"step-{step:08d}"


def _read(path: Path) -> float:
    """The value a committed checkpoint holds, loaded as a job loads one (manifest verified)."""
    state = {"w": torch.zeros(4)}
    ck = Checkpointer(path.parent, rank=0, mode="sync")
    try:
        ck.load(path, state)
    finally:
        ck.close()
    assert bool((state["w"] == state["w"][0]).all())
    return float(state["w"][0])


def test_a_late_group_takes_the_newest_final_checkpoint_and_never_a_stale_one(tmp_path):
    run = tmp_path / "run"
    _commit(run / "checkpoints", 6, 6.0)  # group 0 finished
    _commit(run / "replicas" / "group-1" / "checkpoints", 2, 2.0)
    assert catch_up(run, 1, 2) == (0, 6)
    got = run / "replicas" / "group-1" / "checkpoints" / "step-00000006"
    assert _read(got) == 6.0  # a whole checkpoint: its manifest verifies, DCP loads it
    assert not list(got.parent.glob(".tmp-*"))
    assert catch_up(run, 1, 2) is None  # as new as any: nothing is overwritten
    assert _read(run / "checkpoints" / "step-00000006") == 6.0
    assert _read(run / "replicas" / "group-1" / "checkpoints" / "step-00000002") == 2.0


def test_a_restarting_group_resumes_from_the_newest_step_any_group_committed(tmp_path):
    mine, theirs = tmp_path / "g1", tmp_path / "g0"
    _commit(mine, 2, 2.0)
    _commit(theirs, 4, 4.0)
    ck = Checkpointer(mine, rank=0, keep_last=3, mode="sync")
    states: list[dict] = []

    def state_for(step, path):
        states.append({"w": torch.zeros(4)})
        return states[-1]

    try:
        assert ck.load_latest(state_for, print, also=[theirs]) == (4, theirs / "step-00000004")
        assert float(states[-1]["w"][0]) == 4.0  # what the other group wrote, loaded
        assert ck.load_latest(state_for, print) == (2, mine / "step-00000002")
        assert float(states[-1]["w"][0]) == 2.0
    finally:
        ck.close()


def test_the_drill_reads_every_worlds_restart_log(tmp_path):
    for where in ("logs", "replicas/group-1/logs", "ps-servers/logs", "replicas/group-1/ps-worker/logs"):
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "restarts.jsonl").write_text(json.dumps({"failed_at": 1.0}) + "\n")
    assert set(restart_logs(tmp_path)) == {"job", "group-1", "ps-servers", "ps-worker-1"}
    assert len(chk.read_run(tmp_path, 2)["restarts"]) == 4


def test_a_rank_waiting_on_another_world_keeps_beating_and_a_stopped_one_does_not(tmp_path, monkeypatch):
    monkeypatch.setattr("allhands.heartbeat.WAIT_BEAT_S", 0.05)
    hb = Heartbeat(str(tmp_path), 0)
    hb.beat(3)
    first = read_heartbeats(tmp_path)[0][2]
    with hb.waiting():
        time.sleep(0.3)
    during = read_heartbeats(tmp_path)[0][2]
    assert during > first and read_heartbeats(tmp_path)[0][1] == 3
    time.sleep(0.3)
    assert read_heartbeats(tmp_path)[0][2] == during  # outside a wait, only steps beat


# --------------------------------------------------------------------------- with processes


def test_a_stopped_ps_server_is_blamed_and_restarted_not_its_workers(token_dir, tmp_path):
    """Replica mode, async: the server (rank 2) SIGSTOPs itself at update 5. The servers' own
    watchdog finds it (the workers waiting on it keep beating) and its world restarts it; no
    worker world restarts, and the job completes."""
    from allhands.launch.launcher import LaunchSpec, train_job
    from conftest import tiny_config

    cfg = tiny_config(token_dir, tmp_path / "run", "parallel.sync=ps", "ps.mode=async", "run.steps=8",
                      "checkpoint.interval=2", "checkpoint.mode=sync", "data.eval_batches=0",
                      "fault.mode=replica", "fault.inject=2:5:SIGSTOP", "fault.max_restarts=1",
                      "fault.backoff_s=0", "fault.hang_timeout_s=3")
    done = train_job(cfg, LaunchSpec(nproc=3))
    got = chk.read_run(Path(done.run.dir), 2)
    assert {e["world"] for e in got["restarts"]} == {"ps-servers"}, got["restarts"]
    (event,) = got["restarts"]
    assert event["hang"] and "hung" in event["summary"], event
    assert got["final_steps"] == {"job": 8, "group-1": 8}


def test_a_stop_signal_to_a_ps_jobs_launcher_ends_every_process_of_it(token_dir, tmp_path, cli_env):
    from conftest import ALLHANDS, ROOT, TINY

    run_dir = tmp_path / "run"
    env = {**cli_env, "ALLHANDS_CHAOS_TAG": "ps-stop-test"}
    sets = [f"--set={s}" for s in (*TINY, "parallel.sync=ps", "ps.mode=async", "run.steps=400",
                                   "data.eval_batches=0", "fault.mode=replica", f"data.path={token_dir}",
                                   f"run.dir={run_dir}", "log.interval=1")]
    p = subprocess.Popen([*ALLHANDS, "train", "--nproc", "3", *sets], env=env, cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240  # a loaded host starts three worlds slowly
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.2)
    assert (run_dir / "metrics.jsonl").exists(), "the job never trained"
    time.sleep(1)
    p.send_signal(15)
    _, err = p.communicate(timeout=90)
    last = [line for line in err.splitlines() if line.startswith("allhands: ")][-1]
    assert p.returncode == 143 and last.startswith("allhands: stopped by SIGTERM") and "--resume" in last, err[-2000:]
    end = time.time() + 10
    while chk.tagged_processes("ps-stop-test") and time.time() < end:
        time.sleep(0.2)
    assert not chk.tagged_processes("ps-stop-test")


def test_a_killed_launchers_multiprocessing_directory_is_swept_a_live_one_is_not(tmp_path):
    """What a SIGKILLed launcher leaves in the shared temporary directory (its ``pymp-*`` with
    the forkserver's socket, bound by nobody now) goes at the next job's start; a directory whose
    socket is still bound, that holds anything else, or that is empty (its process has yet to
    bind there) stays."""
    import socket

    from allhands.safefs import sweep_stale

    def pymp(name: str, keep_bound: bool) -> tuple[Path, socket.socket]:
        d = tmp_path / name
        d.mkdir(mode=0o700)
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(d / "listener-x"))
        s.listen()
        if not keep_bound:
            s.close()
        return d, s

    dead, _ = pymp("pymp-dead", keep_bound=False)
    live, held = pymp("pymp-live", keep_bound=True)
    other, _ = pymp("pymp-other", keep_bound=False)
    (other / "arena").write_bytes(b"x")
    empty = tmp_path / "pymp-empty"
    empty.mkdir(mode=0o700)
    try:
        assert sweep_stale(tmp_path) == [dead]
        assert not dead.exists() and live.exists() and other.exists() and empty.exists()
    finally:
        held.close()


def test_a_forkserver_started_during_the_sweep_is_not_swept(tmp_path, monkeypatch):
    """A forkserver that makes its directory and binds its socket while a sweep reads which
    sockets are bound (another launcher's start, mid-sweep): its directory stays."""
    import socket

    from allhands import safefs

    dead = tmp_path / "pymp-dead"
    dead.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead / "listener-x"))
    born, held = tmp_path / "pymp-born", socket.socket(socket.AF_UNIX)
    snapshot = safefs._bound_unix_sockets

    def then_one_starts():
        bound = snapshot()
        born.mkdir(mode=0o700)
        held.bind(str(born / "listener-y"))
        held.listen()
        return bound

    monkeypatch.setattr(safefs, "_bound_unix_sockets", then_one_starts)
    try:
        assert safefs.sweep_stale_pymp(tmp_path) == [dead]
        assert (born / "listener-y").exists()
    finally:
        held.close()


def test_a_live_directory_is_not_swept_from_another_network_namespace(tmp_path):
    """/proc/net/unix lists only this network namespace's sockets: a sweep from another one (a
    lab host's job sharing /tmp) still sees the live forkserver's socket bound here."""
    import shutil
    import socket

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) to enter a new network namespace")
    live = tmp_path / "pymp-live"
    live.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as held:
        held.bind(str(live / "listener-x"))
        held.listen()
        code = "import sys; from pathlib import Path; from allhands.safefs import sweep_stale; " \
               "print(sweep_stale(Path(sys.argv[1])))"
        r = subprocess.run(["unshare", "--net", sys.executable, "-c", code, str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    assert live.exists()
