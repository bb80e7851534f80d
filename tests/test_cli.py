"""The commands end to end, as a user runs them, and the failures a user can cause."""

from __future__ import annotations

import json
import runpy
import socket
import subprocess
import tomllib

import pytest

from allhands.checkpoint import committed

from conftest import ALLHANDS, ROOT
from test_parity import max_rel_diff


def run(argv, env, timeout=240):
    return subprocess.run([*ALLHANDS, *argv], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)


def test_train_then_report_on_the_embedded_corpus(tmp_path, cli_env):
    cli_env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # a fresh machine: corpus not yet prepared
    run_dir = tmp_path / "run"
    r = run(["train", "examples/configs/tiny.toml", "--nproc", "2", "--set", f"run.dir={run_dir}",
             "--set", "run.steps=12", "--set", "checkpoint.interval=6"], cli_env)
    assert r.returncode == 0, r.stderr
    assert "allhands: done: steps 12" in r.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [10, 12]  # log.interval's default, and the last
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time", "comm_bytes",
                "comm_wire_bytes", "comm_time", "comm_exposed", "comm_exposed_frac"):
        assert all(isinstance(row[key], float) for row in steps), key
    assert all(len(row["step_time_rank"]) == 2 for row in steps)
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    assert len(evals) == 3 and evals[-1] < evals[0]
    resolved = tomllib.loads((run_dir / "config.resolved.toml").read_text())
    assert resolved["run"]["steps"] == 12 and resolved["model"]["n_embd"] == 64
    assert [s for s, _ in committed(run_dir / "checkpoints")] == [6, 12]
    assert any((run_dir / "tensorboard").iterdir())

    rep = run(["report", str(run_dir)], cli_env)
    assert rep.returncode == 0, rep.stderr
    for name in ("loss.png", "throughput.png", "step_time.png", "communication.png"):
        png = run_dir / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert not (run_dir / "report" / "experts.png").exists()  # no MoE layers, no expert plot


def test_launch_runs_a_user_script_with_the_python_api(tmp_path, cli_env):
    run_dir = tmp_path / "user"
    r = run(["launch", "--nproc", "2", "examples/user_model.py", "--steps", "30", "--run-dir",
             str(run_dir)], cli_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("final loss") == 2  # every rank returns the metrics
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    assert evals[-1] < 0.5 * evals[0]


def test_a_worker_that_raises_stops_the_job_and_keeps_checkpoints(tmp_path, cli_env):
    run_dir = tmp_path / "flaky"
    # recovery is on by default for a script too (as for `train`): off here, to see the stop
    r = run(["launch", "--nproc", "2", "--max-restarts", "0", "tests/scripts/failing_job.py", str(run_dir)], cli_env)
    assert r.returncode == 1
    summary = [line for line in r.stderr.splitlines() if line.startswith("allhands: error:")]
    assert len(summary) == 1, r.stderr
    assert "worker rank 1" in summary[0] and "ValueError: boom in rank 1's forward" in summary[0]
    assert [s for s, _ in committed(run_dir / "checkpoints")] == [5]


def test_a_failed_worker_s_peer_that_ignores_sigterm_is_stopped_at_once(cli_env, tmp_path):
    """torch's monitor closes the others with SIGTERM and a 30 s grace; a worker blocked in C++
    (or ignoring the signal) is SIGKILLed at once instead: the peer never gets a SIGTERM."""
    record = tmp_path / "peer"
    cli_env["STUCK_PEER_RECORD"] = str(record)
    r = run(["launch", "--nproc", "2", "--max-restarts", "0", "tests/scripts/stuck_peer_job.py"], cli_env,
            timeout=120)
    assert r.returncode == 1 and "ValueError: boom in rank 0" in r.stderr, r.stderr[-3000:]
    assert record.read_text() == "ready\n", "the peer got a SIGTERM, and a grace to wait out, before its SIGKILL"


def _stuck_peer() -> None:
    runpy.run_path(str(ROOT / "tests/scripts/stuck_peer_job.py"))


def test_a_failed_function_worker_s_peer_that_ignores_sigterm_is_stopped_at_once(tmp_path, monkeypatch):
    """The same through the Python API (a function: torch.multiprocessing's context, whose join
    grants a failed job's survivors a 30 s SIGTERM grace of its own): that join waits no grace
    before the SIGKILL."""
    from torch.multiprocessing.spawn import ProcessContext

    from allhands.errors import LaunchError
    from allhands.launch.launcher import LaunchSpec, launch
    from allhands.launch.policy import RestartPolicy

    # torch's join waits out each grace (after the failure, after the SIGTERM) in this method.
    waits, join = [], ProcessContext._join_procs_with_timeout
    monkeypatch.setattr(ProcessContext, "_join_procs_with_timeout",
                        lambda self, timeout: (waits.append(timeout), join(self, timeout))[1])
    record = tmp_path / "peer"
    monkeypatch.setenv("STUCK_PEER_RECORD", str(record))
    with pytest.raises(LaunchError, match="boom in rank 0"):
        launch(_stuck_peer, (), LaunchSpec(nproc=2), threads=1, policy=RestartPolicy(max_restarts=0))
    assert record.read_text().startswith("ready\n")  # the peer was up, ignoring SIGTERM
    assert waits and not any(waits), f"the peer was granted {waits} s before its SIGKILL"


def test_port_in_use_is_one_clear_line(cli_env, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run(["train", "--port", str(port), "--set", "run.steps=1", "--set",
                 f"run.dir={tmp_path / 'run'}"], cli_env, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(f"allhands: error: port {port} on 127.0.0.1 is in use")
    assert "Traceback" not in r.stderr


def test_multi_node_command_through_c10d_rendezvous(tmp_path, cli_env, token_dir):
    """Two 'nodes' on loopback, each `allhands train --nnodes 2 --node-rank i --rdzv-endpoint`,
    train the same job as one node with two workers, to the same parameters."""
    from allhands.checkpoint import load_weights
    from allhands.job import build_reference_model

    from conftest import TINY, tiny_config
    from test_security_network import announced_port

    sets = [a for item in (*TINY, f"data.path={token_dir}") for a in ("--set", item)]
    multi = tmp_path / "multi"
    secret = "a-secret-every-node-shares-0123456789"
    cli_env["ALLHANDS_SECRET"] = secret  # required for a multi-node job (SECURITY.md)
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]

    def node(i: int, port: int) -> subprocess.Popen:
        with open(logs[i], "w") as log:
            return subprocess.Popen(
                [*ALLHANDS, "train", *sets, "--set", f"run.dir={multi}", "--nproc", "1", "--nnodes", "2",
                 "--node-rank", str(i), "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1"],
                env=cli_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)

    procs = [node(0, 0)]  # port 0: node 0 listens on a free one and says which; node 1 dials it
    try:
        procs.append(node(1, announced_port(logs[0], procs[0])))
        for p in procs:
            p.wait(timeout=180)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=60)
    outs = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], [out[-3000:] for out in outs]
    assert not [f for f in multi.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]
    assert all(secret not in out for out in outs)
    single = tmp_path / "single"
    r = run(["train", *sets, "--set", f"run.dir={single}", "--nproc", "2"], cli_env)
    assert r.returncode == 0, r.stderr
    cfg = tiny_config(token_dir, single)
    a = load_weights(build_reference_model(cfg, 257), committed(multi / "checkpoints")[-1][1])
    b = load_weights(build_reference_model(cfg, 257), committed(single / "checkpoints")[-1][1])
    # the suite's parity measure: the nodes' workers run 2 threads each against 1, so the
    # kernels' summation order, and the last bits, differ
    assert max_rel_diff(a.state_dict(), b.state_dict()) <= 1e-5
