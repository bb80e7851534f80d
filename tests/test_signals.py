"""Stop signals are a clean stop: SIGINT/SIGTERM to the launcher finish the step on every rank,
commit its checkpoint and end with one line naming it and the command to resume; a second
SIGINT stops at once; SIGUSR1 checkpoints for a requeue (and the Slurm script requeues and
continues). The step a signal lands on is fixed by fault.inject ``launcher-SIG...``: rank 0 sends
the signal to its launcher after the forward pass and waits until it has been forwarded back."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from allhands.checkpoint import Checkpointer, TrainState, committed, load_weights
from allhands.checkpoint.manifest import verify_manifest
from allhands.config import to_toml
from allhands.errors import ConfigError
from allhands.faults import parse_faults
from allhands.job import build_reference_model
from allhands.launch import stop
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.stopflag import REQUEUE_EXIT, StopFlag, exit_code, signal_of

from conftest import ALLHANDS, ROOT, TINY, tiny_config

SBATCH = ROOT / "examples" / "slurm" / "allhands.sbatch"


def weights(cfg, path):
    return load_weights(build_reference_model(cfg, 257), path).state_dict()


def launch(token_dir, run_dir, env, *sets, nproc=2):
    args = [f"--set={s}" for s in (*TINY, f"data.path={token_dir}", f"run.dir={run_dir}", *sets)]
    return subprocess.Popen([*ALLHANDS, "train", "--nproc", str(nproc), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def wait_for_step(run_dir: Path, step: int, proc, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while step not in steps_logged(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, \
            (proc.kill(), proc.communicate(timeout=60))  # killed first: past the deadline it still runs
        time.sleep(0.05)


def stop_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "stopped" in line or "for requeue" in line]


# ------------------------------------------------------------------ without processes
def test_exit_codes_resume_command_and_final_line(tmp_path):
    assert [exit_code(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)] == [130, 143, 75]
    assert signal_of(143) == signal.SIGTERM and signal_of(1) is None and signal_of(0) is None
    one = LaunchSpec(nproc=2).validated()
    assert stop.resume_command(one, tmp_path / "r 1") == f"allhands train --nproc 2 --resume '{tmp_path}/r 1'"
    many = LaunchSpec(nproc=8, nnodes=4, min_nodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400",
                      local_addr="10.0.0.2", max_restarts=3, insecure=True)
    assert stop.resume_command(many, Path("/r")) == (
        "allhands train --nproc 8 --nnodes 2:4 --node-rank 1 --rdzv-endpoint 10.0.0.1:29400 "
        "--local-addr 10.0.0.2 --max-restarts 3 --insecure --resume /r")
    # the line names the newest committed checkpoint, the step and the command
    Checkpointer(tmp_path / "checkpoints", rank=0).save(3, {"train": TrainState()})
    ckpt = tmp_path / "checkpoints" / "step-00000003"
    line = stop.final_line(stop.Stopped(signal.SIGTERM, clean=True), tmp_path, "CMD")
    assert line == f"allhands: stopped by SIGTERM at step 3; checkpoint {ckpt} is committed; resume with: CMD"
    line = stop.final_line(stop.Stopped(signal.SIGUSR1, clean=True), tmp_path, "CMD")
    assert line.startswith("allhands: checkpointed at step 3 for requeue (SIGUSR1)")
    line = stop.final_line(stop.Stopped(signal.SIGINT, clean=False), tmp_path, "CMD")
    assert f"stopped at once on SIGINT; the last committed checkpoint {ckpt} (step 3) is intact" in line
    # launcher-SIG faults parse; only the stop signals go to the launcher
    assert str(parse_faults("0:3:launcher-sigterm")[0]) == "0:3:launcher-SIGTERM"
    with pytest.raises(ConfigError, match="fault.inject: '0:3:launcher-SIGHUP'"):
        parse_faults("0:3:launcher-SIGHUP")


def test_the_outcome_of_a_worker_group_after_a_stop():
    def failed(code):
        return {0: ProcessFailure(local_rank=0, pid=1, exitcode=code, error_file="/nonexistent")}

    req = stop.StopRequest()
    assert req.outcome(failed(1)) is None  # a real failure: the restart policy's
    s = req.outcome(failed(143))  # the workers alone got SIGTERM and stopped cleanly
    assert (s.signum, s.clean) == (signal.SIGTERM, True)
    req.signum = signal.SIGINT
    s = req.outcome(failed(-9))  # the launcher's stop, but a worker died meanwhile
    assert (s.signum, s.clean) == (signal.SIGINT, False)


def test_the_first_signal_is_forwarded_and_the_second_kills(tmp_path):
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: print('got', flush=True))\n"
            "print('ready', flush=True)\ntime.sleep(60)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        assert p.stdout.readline() == "ready\n"
    req = stop.StopRequest()
    req.workers = lambda: [p.pid for p in procs]
    req.on_signal(signal.SIGTERM)
    assert [p.stdout.readline() for p in procs] == ["got\n", "got\n"]
    assert all(p.poll() is None for p in procs)
    with pytest.raises(stop.Stopped) as e:
        req.on_signal(signal.SIGINT)
    assert (e.value.signum, e.value.clean) == (signal.SIGTERM, False)
    assert [p.wait(timeout=30) for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]


def test_a_worker_flag_defers_the_first_signal_and_not_the_second():
    flag = StopFlag()
    with flag.installed():
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.wait(60) and flag.signum == signal.SIGUSR1
        with pytest.raises(KeyboardInterrupt):  # in-process, a second Ctrl-C is Python's own
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the previous handler is back


# ------------------------------------------------------------------ jobs of 2 gloo workers
def test_sigterm_stops_at_that_step_and_resume_is_bit_identical(token_dir, tmp_path, cli_env):
    job = ("run.steps=6", "checkpoint.interval=0", "checkpoint.keep_last=5")
    ref = tmp_path / "undisturbed"
    cfg = train_job(tiny_config(token_dir, ref, *job), LaunchSpec(nproc=2))
    run_dir = tmp_path / "run"
    p = launch(token_dir, run_dir, cli_env, *job, "fault.inject=0:3:launcher-SIGTERM")
    _, err = p.communicate(timeout=240)
    assert p.returncode == 143, err
    ckpt = run_dir / "checkpoints" / "step-00000003"
    (line,) = stop_lines(err)
    assert line == (f"allhands: stopped by SIGTERM at step 3; checkpoint {ckpt} is committed; "
                    f"resume with: allhands train --nproc 2 --resume {run_dir}")
    assert "Traceback" not in err and "SignalException" not in err
    assert [s for s, _ in committed(run_dir / "checkpoints")] == [3]
    assert steps_logged(run_dir) == [1, 2, 3]  # every rank stopped after step 3, none later
    # the printed command, as it is
    cmd = shlex.split(line.split("resume with: ")[1])
    assert cmd[:2] == ["allhands", "train"]
    r = subprocess.run([*ALLHANDS, *cmd[1:]], env=cli_env, cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr
    a = weights(cfg, ref / "checkpoints" / "step-00000006")
    b = weights(cfg, run_dir / "checkpoints" / "step-00000006")
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after the stop and resume"


def test_sigint_stops_cleanly_with_exit_130_and_one_line(token_dir, tmp_path, cli_env):
    run_dir = tmp_path / "run"
    # an async save in flight at step 2 is finished, and step 3 saved at the stop
    p = launch(token_dir, run_dir, cli_env, "run.steps=6", "checkpoint.interval=2",
               "checkpoint.mode=async", "fault.inject=1:3:launcher-SIGINT")
    _, err = p.communicate(timeout=240)
    assert p.returncode == 130, err
    (line,) = stop_lines(err)
    assert f"stopped by SIGINT at step 3; checkpoint {run_dir}/checkpoints/step-00000003 is committed" in line
    assert line.endswith(f"resume with: allhands train --nproc 2 --resume {run_dir}")
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err
    for _, path in committed(run_dir / "checkpoints"):
        verify_manifest(path)
    assert [s for s, _ in committed(run_dir / "checkpoints")] == [2, 3]


def test_a_second_sigint_stops_at_once_and_keeps_the_last_checkpoint(token_dir, tmp_path, cli_env):
    run_dir = tmp_path / "run"
    # rank 1 hangs before step 3, so the first SIGINT's clean stop cannot finish
    p = launch(token_dir, run_dir, cli_env, "run.steps=6", "checkpoint.interval=2",
               "log.interval=1", "fault.inject=1:3:hang")
    wait_for_step(run_dir, 2, p)
    deadline = time.monotonic() + 60
    while not committed(run_dir / "checkpoints") and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    time.sleep(1)
    assert p.poll() is None
    p.send_signal(signal.SIGINT)
    try:  # a clean stop would wait on rank 1 until the hang timeout (180 s)
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"the second SIGINT did not stop the job: {p.communicate(timeout=60)[1][-3000:]}")
    assert p.returncode == 130, err
    ckpt = run_dir / "checkpoints" / "step-00000002"
    (line,) = stop_lines(err)
    assert f"stopped at once on SIGINT; the last committed checkpoint {ckpt} (step 2) is intact" in line
    assert "Traceback" not in err
    verify_manifest(ckpt)


def test_sigusr1_checkpoints_and_the_slurm_script_requeues_and_continues(token_dir, tmp_path, cli_env):
    """The batch script, as Slurm would run it on one node: SIGUSR1 to the batch shell reaches
    allhands through srun; it exits 75, the script requeues; the requeued run continues."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol-calls"
    stand_ins = {
        "scontrol": f'[ "$1 $2" = "show hostnames" ] && echo node1 && exit 0\necho "$*" >> {calls}\n',
        "getent": 'echo "127.0.0.1 STREAM node1"\n',
        # srun: one task, in the background, with the signals srun forwards to its tasks
        "srun": 'while [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 LOCAL_ADDR=127.0.0.1 "$@" &\n'
                'c=$!\nfor s in USR1 TERM INT; do trap "kill -$s $c" $s; done\n'
                'wait $c; while kill -0 $c 2>/dev/null; do wait $c; done; wait $c\n'}
    for name, body in stand_ins.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / "run"
    config = tmp_path / "job.toml"
    # from step 3 rank 0 is slow: the signal lands mid-run
    config.write_text(to_toml(tiny_config(token_dir, run_dir, "run.steps=8", "log.interval=1",
                                          "fault.inject=0:3:slow=30")))
    env = dict(cli_env, PATH=f"{bin_dir}:{cli_env['PATH']}", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="node1", SLURM_NNODES="1", NPROC="2", CONFIG=str(config),
               RUN_DIR=str(run_dir), RDZV_PORT="0", ALLHANDS_SECRET="9f" * 16,  # one node: it picks a port
               ALLHANDS=str(Path(sys.executable).parent / "allhands"))
    first = subprocess.Popen(["bash", str(SBATCH)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    wait_for_step(run_dir, 2, first)
    first.send_signal(signal.SIGUSR1)
    out, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    (line,) = stop_lines(err)
    step = int(line.split("checkpointed at step ")[1].split()[0])
    assert 2 <= step < 8 and [s for s, _ in committed(run_dir / "checkpoints")][-1] == step
    assert f"requeueing job 4242 to continue {run_dir}" in out
    assert calls.read_text() == "requeue 4242\n"
    # the requeued job: the same script, the same environment
    second = subprocess.run(["bash", str(SBATCH)], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=240)
    assert second.returncode == 0, second.stderr
    assert f"resumed from step {step}" in second.stderr
    assert steps_logged(run_dir)[-1] == 8 and calls.read_text() == "requeue 4242\n"


def test_the_python_api_stops_on_ctrl_c_with_one_line_and_a_checkpoint(token_dir, tmp_path, capfd):
    import allhands

    run_dir = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)
    # the worker (this process) gets SIGINT after the forward pass of step 2
    cfg = tiny_config(token_dir, run_dir, "run.steps=6", "fault.inject=0:2:SIGINT")
    with pytest.raises(KeyboardInterrupt):
        allhands.train(cfg)
    err = capfd.readouterr().err
    (line,) = stop_lines(err)
    ckpt = run_dir / "checkpoints" / "step-00000002"
    assert line == (f"allhands: stopped by SIGINT at step 2; checkpoint {ckpt} is committed; "
                    f"continue with allhands.train(..., resume={str(run_dir)!r})")
    verify_manifest(ckpt)
    assert signal.getsignal(signal.SIGINT) is before
    assert REQUEUE_EXIT == 75
