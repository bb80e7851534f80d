"""Coordination logic without worker processes: fault specs and plans, restart policy and the
supervise loop, hang detection, the non-finite policy, checkpoint commit/fallback and the config
check on resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from allhands.checkpoint import FORMAT_VERSION, META_NAME, Checkpointer, check_compatible, committed
from allhands.config import Config
from allhands.errors import CheckpointError, ConfigError, LaunchError
from allhands.faults import Fault, NonFiniteError, NonFiniteGuard, parse_faults, plan_faults
from allhands.heartbeat import Heartbeat, find_hang, read_heartbeats
from allhands.launch.policy import RestartPolicy, WorkerFailure
from allhands.launch.supervisor import Watchdog, supervise


def test_fault_specs_parse_and_refuse_with_the_field_path():
    assert parse_faults(" 1:7:sigkill, 0:3:nan ,2:3:ckpt") == [Fault(3, 0, "nan"), Fault(3, 2, "ckpt"),
                                                               Fault(7, 1, "SIGKILL")]
    assert parse_faults("") == []
    for bad in ("1:7", "a:1:SIGKILL", "1:0:nan", "1:2:SIGNOPE", "1:2:explode"):
        with pytest.raises(ConfigError, match=r"^fault.inject: "):
            parse_faults(bad)


def test_fault_plans_are_seeded_distinct_and_hit_checkpoint_writes():
    plan = plan_faults(7, 5, steps=40, world_size=3, ckpt_interval=5)
    assert plan == plan_faults(7, 5, steps=40, world_size=3, ckpt_interval=5)
    assert plan != plan_faults(8, 5, steps=40, world_size=3, ckpt_interval=5)
    assert len({f.step for f in plan}) == 5 and all(2 <= f.step < 40 and 0 <= f.rank < 3 for f in plan)
    ckpt = [f for f in plan if f.kind == "ckpt"]
    assert ckpt and all(f.step % 5 == 0 for f in ckpt)
    assert parse_faults(",".join(map(str, plan))) == plan  # a plan is a replayable spec
    with pytest.raises(ConfigError, match="--faults"):
        plan_faults(0, 9, steps=8, world_size=2, ckpt_interval=2)


def test_restart_policy_backs_off_and_classifies_causes():
    p = RestartPolicy(max_restarts=2, backoff_s=1.5, max_backoff_s=5)
    assert [p.delay(k) for k in (1, 2, 3, 4)] == [1.5, 3.0, 5, 5]
    killed = "worker rank 1 (pid 9) on node a failed: killed by SIGKILL"
    assert p.decide(killed, 0, 0, True) == "restart"
    assert p.decide(killed, 2, 0, True) == "give_up"
    assert p.decide("worker rank 0 failed: NonFiniteError: non-finite", 0, 0, True) == "fatal"
    assert p.decide("worker rank 0 failed: ConfigError: model.n_embd: differs", 0, 0, False) == "fatal"
    flake = "worker rank 1 failed: RuntimeError: [gloo] connectFullMesh failed: Connection refused"
    assert p.decide(flake, 2, 0, False) == "flake"  # not counted, even with no restarts left
    assert p.decide(flake, 2, 2, False) == "give_up"  # but not forever
    assert p.decide(flake, 0, 0, True) == "restart"  # after progress it is a real failure


@pytest.mark.serial  # times the backoff gaps to 0.2 s
def test_supervise_restarts_with_backoff_then_gives_up_with_one_line(tmp_path, capsys):
    calls = []

    def attempt(n, hb_dir):
        calls.append((n, time.monotonic()))
        raise WorkerFailure(f"worker rank {n % 2} (pid {100 + n}) on node x failed: killed by SIGKILL")

    policy = RestartPolicy(max_restarts=2, backoff_s=0.2)
    with pytest.raises(LaunchError) as info:
        supervise(attempt, policy, run_dir=tmp_path)
    msg = str(info.value)
    assert msg.startswith("worker rank 0 (pid 102)") and "gave up after 2 restart(s)" in msg
    assert "\n" not in msg
    assert [n for n, _ in calls] == [0, 1, 2]
    gaps = [b - a for (_, a), (_, b) in zip(calls, calls[1:])]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4  # exponential backoff
    events = [json.loads(line) for line in (tmp_path / "logs" / "restarts.jsonl").read_text().splitlines()]
    assert [e["verdict"] for e in events] == ["restart", "restart", "give_up"]
    err = capsys.readouterr().err
    assert "restart 1/2 from the start (no committed checkpoint yet) after 0.2 s" in err

    calls.clear()

    def progressing(n, hb_dir):  # completes steps before failing: no crash loop, no doubling
        calls.append((n, time.monotonic()))
        hb = Heartbeat(str(hb_dir), 0)
        for step in (4, 5, 6):
            hb.beat(step)
        raise WorkerFailure("worker rank 0 (pid 1) on node x failed: killed by SIGKILL")

    with pytest.raises(LaunchError, match="gave up after 2 restart"):
        supervise(progressing, policy, run_dir=None)
    gaps = [b - a for (_, a), (_, b) in zip(calls, calls[1:])]
    assert all(0.2 <= g < 0.39 for g in gaps), gaps

    ok = []
    supervise(lambda n, hb: ok.append(n) if n else (_ for _ in ()).throw(WorkerFailure("x killed")),
              RestartPolicy(max_restarts=1, backoff_s=0), run_dir=None)
    assert ok == [1]

    def fatal(n, hb):
        calls.append(n)
        raise WorkerFailure("worker rank 0 (pid 1) on node x failed: CheckpointError: bad file")

    calls.clear()
    with pytest.raises(LaunchError, match="^worker rank 0 .*CheckpointError: bad file$"):
        supervise(fatal, RestartPolicy(max_restarts=3, backoff_s=0), run_dir=None)
    assert calls == [0]


def test_find_hang_blames_the_rank_that_stopped_first():
    now = 1000.0
    alive = lambda pid: pid != 13  # noqa: E731
    beats = {0: (10, 5, now - 9.0, "a", False),   # got to step 5, blocked waiting for rank 1
             1: (11, 4, now - 9.5, "a", False),   # never started step 5: the hung one
             2: (12, 5, now - 1.0, "b", False),
             3: (13, 2, now - 99, "b", False),    # dead: the agent's business, not a hang
             4: (14, 1, now - 99, "b", True)}     # finished
    (h,) = find_hang(beats, now, 8.0, alive)
    assert (h.rank, h.pid, h.step, h.host) == (1, 11, 4, "a") and h.stale_s == pytest.approx(9.5)
    assert "worker rank 1 (pid 11) on node a hung: no progress for 9.5 s" in h.describe(8)
    assert find_hang(beats, now, 10.0, alive) == []


def test_watchdog_kills_a_stalled_process_and_records_it(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        for rank, (p, step) in enumerate(zip(procs, (3, 4))):
            (tmp_path / f"rank-{rank}").write_text(f"{p.pid} {step} {time.time()!r} host 0 1\n")
        with Watchdog(tmp_path, 0.5) as dog:
            assert procs[0].wait(timeout=60) == -9
        assert procs[1].poll() is None
        assert [h.rank for h in dog.hangs] == [0] and dog.hangs[0].stale_s >= 0.5  # not before the timeout
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=60)


def test_heartbeat_round_trips(tmp_path):
    hb = Heartbeat(str(tmp_path), 3)
    t0 = time.time()
    hb.beat(7)
    hb.beat(8)
    (pid, step, t, host, done, first), = read_heartbeats(tmp_path).values()
    assert (step, first) == (8, 7) and not done and t0 <= t <= time.time()
    hb.beat(9, done=True)
    assert read_heartbeats(tmp_path)[3][4]
    Heartbeat("", 0).beat(1)  # outside a supervised job: nothing to do


def test_nonfinite_guard_policies():
    g = NonFiniteGuard("skip", 3)
    assert [g.check(f, s) for s, f in enumerate([True, False, False, True, False], 1)] == \
        ["ok", "skip", "skip", "ok", "skip"]
    with pytest.raises(NonFiniteError, match="in 3 steps in a row up to step 7"):
        g.check(False, 6), g.check(False, 7)
    assert NonFiniteGuard("rollback", 2).check(False, 1) == "rollback"
    with pytest.raises(NonFiniteError, match=r"at step 4 \(fault.nonfinite=stop\)"):
        NonFiniteGuard("stop", 5).check(False, 4)


def _state(v: float):
    return {"w": torch.full((4, 3), v), "n": torch.tensor(int(v))}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_checkpointer_commits_keeps_last_and_falls_back(tmp_path, mode):
    ck = Checkpointer(tmp_path, rank=0, keep_last=2, mode=mode, meta={"config": {"a": {"b": 1}}})
    for step in (1, 2, 3):
        src = _state(step)
        ck.save(step, src)
        src["w"].add_(100)  # training goes on while the write runs: the copy is already staged
    ck.wait()
    ck.close()
    assert [s for s, _ in committed(tmp_path)] == [2, 3] and ck.failures == 0
    meta = json.loads((tmp_path / "step-00000003" / META_NAME).read_text())
    assert meta["format"] == FORMAT_VERSION and meta["step"] == 3 and meta["config"] == {"a": {"b": 1}}

    shard = next((tmp_path / "step-00000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-5])  # truncated
    warnings = []
    out = _state(0)
    step, _ = ck.load_latest(lambda s, p: out, warnings.append)
    assert step == 2 and torch.equal(out["w"], torch.full((4, 3), 2.0))
    assert len(warnings) == 1 and "has" in warnings[0] and "bytes" in warnings[0] and "falling back" in warnings[0]


def test_a_failed_save_is_counted_and_leaves_nothing(tmp_path):
    target = tmp_path / "ckpt"
    target.write_text("not a directory")  # mkdir fails on every rank alike, for root too
    ck = Checkpointer(target, rank=0, mode="async")
    ck.save(1, _state(1))
    ck.wait()
    assert ck.failures == 1 and "checkpoint step 1 was not saved" in ck.warnings[0]
    assert target.read_text() == "not a directory"


def test_resume_config_check_names_every_incompatible_field(tmp_path):
    saved = Config()
    (tmp_path / META_NAME).write_text(json.dumps({"format": FORMAT_VERSION, "config": saved.to_dict()}))
    now = Config()
    now.optim.lr, now.run.steps = 1.0, 5  # allowed to change
    check_compatible(tmp_path, now.to_dict())
    now.model.n_embd, now.run.global_batch = 256, 64
    with pytest.raises(ConfigError, match=r"^model.n_embd: the config differs from checkpoint .* in "
                                          r"model.n_embd \(saved 128, now 256\), run.global_batch "
                                          r"\(saved 32, now 64\);"):
        check_compatible(tmp_path, now.to_dict())
    (tmp_path / META_NAME).write_text(json.dumps({"format": FORMAT_VERSION + 1}))
    with pytest.raises(CheckpointError, match="format"):
        check_compatible(tmp_path, now.to_dict())


def test_elastic_nnodes_range_must_keep_the_global_batch_divisible(tmp_path, token_dir):
    from allhands.launch.launcher import LaunchSpec, train_job

    from conftest import tiny_config

    cfg = tiny_config(token_dir, tmp_path / "run", "run.global_batch=16")
    spec = LaunchSpec(nproc=2, nnodes=4, min_nodes=2, rdzv_endpoint="127.0.0.1:29999", insecure=True)
    with pytest.raises(ConfigError, match=r"^run.global_batch: 16 is not allowed; must be divisible by "
                                          r"data-parallel ranks x micro_batches = 6 x 1 = 6 \(--nnodes 2:4 may shrink "
                                          r"the job to 3 node\(s\) x 2 workers\)$"):
        train_job(cfg, spec)
    with pytest.raises(ConfigError, match="--nnodes"):
        LaunchSpec(nproc=2, nnodes=2, min_nodes=3, rdzv_endpoint="h:1").validated()


def test_injected_faults_fire_once_per_run_directory(tmp_path):
    from allhands.faults import FaultInjector, InjectedFault, fired_at

    inj = FaultInjector("0:2:exception,0:3:oom,0:4:nan,1:2:exception", 0, tmp_path)
    loss = torch.tensor(1.0)
    assert inj.after_forward(1, loss) is loss
    with pytest.raises(InjectedFault, match="step 2"):
        inj.after_forward(2, loss)
    with pytest.raises(torch.OutOfMemoryError):
        inj.after_forward(3, loss)
    assert torch.isnan(inj.after_forward(4, loss))
    again = FaultInjector("0:2:exception,0:3:oom,0:4:nan", 0, tmp_path)  # the restarted worker
    assert all(again.after_forward(s, loss) is loss for s in (2, 3, 4))
    assert set(fired_at(tmp_path)) == {"0:2:exception", "0:3:oom", "0:4:nan"}
    assert FaultInjector("1:5:ckpt", 1, tmp_path).ckpt_writer_hook(4) is None
    assert FaultInjector("1:5:ckpt", 1, tmp_path).ckpt_writer_hook(6) is not None


def test_failure_lines_name_the_lost_peer_node_and_its_ranks():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from allhands.launch.elastic import describe_failures

    def failure(rank, message, pid, exitcode=1):
        f = ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file="")
        if message:  # what torch reads from the error file of a worker that raised
            f.message = message
        return f

    gloo = ("RuntimeError: Got the following error when running the callback: RuntimeError: "
            "[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.61.0.2]:32440. This "
            "is typically caused by a remote worker crashing.\n\nAt:\n  hooks.py(31)")
    failures = {0: failure(0, {"message": gloo}, 11), 1: failure(1, "", 12, exitcode=-15)}
    line = describe_failures(failures, 0, "10.61.0.1", {"10.61.0.2": (2, 2)})
    assert line == ("worker rank 0 (pid 11) on node 10.61.0.1 failed: lost node 10.61.0.2 (worker "
                    "ranks 2-3): gloo: Connection closed by peer [10.61.0.2]:32440")
    killed = describe_failures({3: failure(3, "", 9, exitcode=-9)}, 3, "h")
    assert killed == "worker rank 3 (pid 9) on node h failed: killed by SIGKILL"
    # One node: no node was lost; the peer that lost a worker names that worker and how it died.
    local = gloo.replace("10.61.0.2", "127.0.0.1")
    line = describe_failures({0: failure(0, {"message": local}, 11), 1: failure(1, "", 12, exitcode=-9)},
                             1, "h", single_node=True)
    assert line == ("worker rank 1 (pid 12) on node h failed: killed by SIGKILL; worker rank 0 (pid 11) "
                    "on node h failed: its peer worker rank 1 died (killed by SIGKILL)")


def ends_with(code: int) -> None:
    """A worker that exits with ``code`` (-N: killed by signal N; 99: still running) after 0.3 s."""
    time.sleep(0.3 if code != 99 else 60)
    if code < 0:
        os.kill(os.getpid(), -code)
    os._exit(code)  # not through torch's ``record``, which keeps a worker that exits 0 waiting


def test_an_agent_sees_its_worker_fail_without_taking_its_exit_status_from_torch(tmp_path):
    """The settle check (elastic.exit_codes) tells a worker that exited with an error or a signal
    from one still running or done, from the process objects of torch's own process context
    (forked workers are the forkserver's children, not this process's), and leaves the failure
    for torch's monitor to report."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from allhands.launch import forkstart
    from allhands.launch.elastic import exit_codes

    ends = {0: 3, 1: -9, 2: 0, 3: 99}
    # Through forkstart.forked, as the agent starts them: a worker with the server's SIGTERM still
    # blocked would outlast torch's close() (SIGTERM, then SIGKILL after 30 s) when torch's monitor
    # sees rank 0 fail while rank 3 still runs.
    ctx = start_processes("t", forkstart.forked, envs={r: {} for r in ends},
                          args={r: (forkstart.Inherited(), ends_with, c) for r, c in ends.items()},
                          logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
                          start_method=forkstart.ensure_server())
    try:
        assert not any(exit_codes(ctx).values())  # all still running
        deadline = time.monotonic() + 60
        while exit_codes(ctx)[2] is None or not (exit_codes(ctx)[0] and exit_codes(ctx)[1]):
            assert time.monotonic() < deadline, f"the children were never seen to end: {exit_codes(ctx)}"
            time.sleep(0.05)
        assert exit_codes(ctx) == {0: 3, 1: -9, 2: 0, 3: None}
        result = ctx.wait(0)  # torch's monitor still sees a failure, with its exit code
        assert result.is_failed() and [f.exitcode == ends[r] for r, f in result.failures.items()] == [True]
    finally:
        ctx.close()


def test_the_agent_reports_every_failed_local_worker_not_only_the_lowest_rank(tmp_path):
    """torch's monitor reports the lowest failed local rank and terminates the rest at once. When
    rank 1 raises a start-up flake, rank 0 fails at once with "Connection closed by peer" and can
    be the one reported: the flake would then count as a restart (seen once in the suite,
    tests/test_multinode_flake.py; every time with the agent's monitor slowed by 1.5 s). Here rank
    0 exits first and rank 1 only 0.5 s later, through torch's own ``record`` and error file: the
    agent waits for it and adds it, so the verdict is the flake."""
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from allhands.launch.elastic import LocalAgent, describe_failures, first_failure

    files = {r: tmp_path / f"error-{r}.json" for r in (0, 1)}
    code = ("import os, sys, time\n"
            "from torch.distributed.elastic.multiprocessing.errors import record\n"
            "@record\ndef main():\n    time.sleep({})\n    raise RuntimeError({!r})\n"
            "main()\n")
    causes = {0: "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242",
              1: "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error"}
    procs = {r: subprocess.Popen([sys.executable, "-c", code.format(0.0 if r == 0 else 0.5, causes[r])],
                                 env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(files[r])},
                                 stderr=subprocess.DEVNULL) for r in (0, 1)}
    try:
        deadline = time.monotonic() + 60
        while not os.waitid(os.P_PID, procs[0].pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            assert time.monotonic() < deadline, "rank 0 never exited"
            time.sleep(0.01)
        agent = LocalAgent.__new__(LocalAgent)  # only the process context is read
        agent._pcontext = SimpleNamespace(pids=lambda: {r: p.pid for r, p in procs.items()}, error_files=files,
                                          subprocess_handlers={r: SimpleNamespace(proc=p) for r, p in procs.items()})
        exits = agent._settle_local_exits()
        assert sorted(exits) == [0, 1] and exits[1] == (procs[1].pid, 1)
        result = SimpleNamespace(failures={0: ProcessFailure(0, procs[0].pid, 1, str(files[0]))})
        group = SimpleNamespace(workers=[SimpleNamespace(local_rank=r, global_rank=r) for r in (0, 1)])
        agent._add_local_failures(result, group, exits)
        assert sorted(result.failures) == [0, 1]
        assert first_failure(result.failures) == 1  # rank 0 only lost it
        summary = describe_failures(result.failures, first_failure(result.failures), "127.0.0.1",
                                    single_node=True)
        assert summary.startswith("worker rank 1") and "connectFullMesh" in summary, summary
        assert summary.endswith("failed: its peer worker rank 1 failed first"), summary
        assert RestartPolicy(max_restarts=0).decide(summary, 0, 0, False) == "flake"
        assert RestartPolicy(max_restarts=0).decide(describe_failures(
            {0: result.failures[0]}, 0, "127.0.0.1"), 0, 0, False) == "give_up"  # rank 0 alone
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=60)


def test_rendezvous_timeouts_come_from_the_config_and_are_checked(tmp_path, token_dir):
    from allhands.config import apply_override, validate
    from allhands.launch.launcher import rendezvous_timeouts
    from allhands.launch.rundir import resolve_run

    from conftest import tiny_config

    cfg = Config()
    for item in ("fault.node_timeout_s=6", "fault.rdzv_last_call_s=2.5", "fault.rdzv_join_timeout_s=120"):
        apply_override(cfg, item)
    assert rendezvous_timeouts(cfg).configs() == {"join_timeout": 120, "last_call_timeout": 2,
                                                  "keep_alive_interval": 2, "keep_alive_max_attempt": 3}
    apply_override(cfg, "fault.node_timeout_s=1")
    with pytest.raises(ConfigError, match=r"^fault.node_timeout_s: "):
        validate(cfg, need_data=False)

    # A requeued node runs its original command again: the run directory holding checkpoints of
    # the same job is rejoined; another job's config is still refused, and so is a single node.
    run_dir = tmp_path / "run"
    first = resolve_run(tiny_config(token_dir, run_dir), resume=None, world_size=2, multi_node=True)
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    again = resolve_run(tiny_config(token_dir, run_dir), resume=None, world_size=2, multi_node=True)
    assert again.to_dict() == first.to_dict()
    with pytest.raises(ConfigError, match="^run.dir: .* already holds checkpoints"):
        resolve_run(tiny_config(token_dir, run_dir, "optim.lr=0.5"), resume=None, world_size=2,
                    multi_node=True)
    with pytest.raises(ConfigError, match="^run.dir: .* already holds checkpoints"):
        resolve_run(tiny_config(token_dir, run_dir), resume=None, world_size=2)
