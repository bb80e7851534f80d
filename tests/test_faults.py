"""Failures lose nothing: injected faults on 2-3 gloo workers, recovered or stopped as documented.

Faults are deterministic (fault.inject RANK:STEP:KIND, fired once per run directory), so a failing
test replays exactly. Every job is the tiny model for 6 steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from allhands.checkpoint import committed, load_weights
from allhands.config import Config
from allhands.errors import ConfigError, LaunchError
from allhands.faults import FaultInjector, fired_at, parse_faults
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.checkpoint.manifest import verify_manifest
from allhands.job import Job, build_reference_model

from conftest import TINY, cli, shared_once, tiny_config

JOB = ("run.steps=6", "checkpoint.interval=2", "checkpoint.keep_last=5", "fault.backoff_s=0.1")


def weights(cfg, path):
    return load_weights(build_reference_model(cfg, 257), path).state_dict()


def assert_same(a, b, exact=True):
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs"
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def restarts(run_dir):
    path = run_dir / "logs" / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_nothing_corrupt(ckpt_dir, finished=True):
    """Every committed checkpoint verifies. A job that died may leave the ``.tmp-`` directory
    of the save it interrupted (resume ignores it); a finished job's next saves removed it."""
    if finished:
        assert not list(ckpt_dir.glob(".tmp-*")), "an uncommitted checkpoint was left behind"
    for _, path in committed(ckpt_dir):
        verify_manifest(path)


@pytest.fixture(scope="module")
def undisturbed(token_dir, tmp_path_factory):
    """The reference: the same 6-step job without faults. Returns (config, final weights)."""
    def build(directory: Path) -> dict:
        return train_job(tiny_config(token_dir, directory / "run", *JOB), LaunchSpec(nproc=2)).to_dict()
    cfg = Config.from_dict(shared_once(tmp_path_factory, "faults-undisturbed", build))
    return cfg, weights(cfg, Path(cfg.run.dir) / "checkpoints" / "step-00000006")


def test_sigkill_mid_step_and_during_an_async_write_recover_to_the_undisturbed_parameters(
        token_dir, tmp_path, undisturbed, capfd):
    ref_cfg, ref = undisturbed
    run_dir = tmp_path / "run"
    # Rank 1 dies inside the step-4 checkpoint write (the async writer thread), then mid-step 5;
    # no restart setting: recovery is on by default, and the start says so.
    cfg = tiny_config(token_dir, run_dir, *JOB, "fault.inject=1:4:ckpt,1:5:SIGKILL")
    train_job(cfg, LaunchSpec(nproc=2))
    err = capfd.readouterr().err
    assert "allhands: recovery: up to 3 restart(s) from the last checkpoint" in err
    assert "lost node" not in err  # one node: a worker died, no node was lost
    events = restarts(run_dir)
    assert [e["verdict"] for e in events] == ["restart", "restart"], err
    # The write killed at step 4 never committed: the job went back to step 2.
    assert events[0]["resume_from"] == "checkpoint step 2"
    assert "worker rank 1" in events[0]["summary"] and "SIGKILL" in events[0]["summary"]
    assert "restart 1/3 from checkpoint step 2" in err
    assert set(fired_at(run_dir)) == {"1:4:ckpt", "1:5:SIGKILL"}
    assert_nothing_corrupt(run_dir / "checkpoints")
    assert_same(weights(ref_cfg, run_dir / "checkpoints" / "step-00000006"), ref)


def test_restart_limit_exceeded_stops_cleanly_with_one_line(token_dir, tmp_path, capfd):
    run_dir = tmp_path / "run"
    sets = [f"--set={s}" for s in (*TINY, *JOB, f"data.path={token_dir}", f"run.dir={run_dir}",
                                   "fault.inject=1:2:SIGKILL,0:4:SIGKILL")]
    r = cli(["train", "--nproc", "2", "--max-restarts", "1", *sets], capfd)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("allhands: error: worker rank 0"), r.stderr
    assert "killed by SIGKILL" in last and "gave up after 1 restart(s)" in last
    # The fix, for this path: continue from the checkpoint, or allow more restarts.
    assert f"with --resume {run_dir}, or allow more with --max-restarts N" in last, last
    assert "lost node" not in r.stderr  # one node: a worker died, no node was lost
    assert "Traceback" not in r.stderr
    assert [e["verdict"] for e in restarts(run_dir)] == ["restart", "give_up"]
    assert_nothing_corrupt(run_dir / "checkpoints", finished=False)


@pytest.mark.serial  # how soon the hang is named
def test_a_hung_rank_is_named_within_the_timeout(token_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(token_dir, run_dir, *JOB, "fault.inject=1:3:hang", "fault.hang_timeout_s=3",
                      "fault.max_restarts=0")
    with pytest.raises(LaunchError, match=r"worker rank 1 \(pid \d+\) on node \S+ hung: no progress "
                                          r"for [\d.]+ s .*hang_timeout_s=3\)"):
        train_job(cfg, LaunchSpec(nproc=2))
    (event,) = restarts(run_dir)
    hung_since = fired_at(run_dir)["1:3:hang"]
    assert event["hang"] and event["failed_at"] - hung_since < 3 + 4  # timeout + poll and teardown
    assert "worker rank 0" not in event["summary"].split("; ")[0]


def test_a_corrupted_checkpoint_falls_back_to_the_previous_one(token_dir, tmp_path, undisturbed, capfd):
    ref_cfg, ref = undisturbed
    run_dir = tmp_path / "run"
    cfg = tiny_config(token_dir, run_dir, *JOB, "run.steps=4")
    train_job(cfg, LaunchSpec(nproc=2))
    shard = run_dir / "checkpoints" / "step-00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x55
    shard.write_bytes(bytes(data))
    capfd.readouterr()
    train_job(tiny_config(token_dir, run_dir, *JOB), LaunchSpec(nproc=2), resume=str(run_dir))
    err = capfd.readouterr().err
    warn = [line for line in err.splitlines() if "falling back" in line]
    assert len(warn) == 1 and "__0_0.distcp" in warn[0] and "SHA-256" in warn[0], err
    assert "resumed from step 2" in err
    assert_same(weights(ref_cfg, run_dir / "checkpoints" / "step-00000006"), ref)


def test_nan_rollback_reaches_the_undisturbed_parameters(token_dir, tmp_path, undisturbed, capfd):
    ref_cfg, ref = undisturbed
    run_dir = tmp_path / "run"
    cfg = tiny_config(token_dir, run_dir, *JOB, "fault.inject=1:4:nan", "fault.nonfinite=rollback")
    train_job(cfg, LaunchSpec(nproc=2))
    assert "rolled back to step 2" in capfd.readouterr().err
    last = [m for m in metrics(run_dir) if "loss" in m][-1]
    assert last["rollbacks"] == 1 and last["nonfinite_skips"] == 1
    assert_same(weights(ref_cfg, run_dir / "checkpoints" / "step-00000006"), ref)


def test_a_nan_between_logged_steps_is_skipped_on_the_device_alike(token_dir, tmp_path, capfd):
    """log.interval=3: the NaN at step 2 is skipped by the fused optimizer on the device, read at
    step 3 (no host sync at step 2), to the parameters of the run that reads it at step 2; two
    in a row between logged steps stop the run at the logged step, naming the last one."""
    runs = {}
    for interval in (3, 1):
        run_dir = tmp_path / f"every-{interval}"
        cfg = tiny_config(token_dir, run_dir, *JOB, "fault.inject=0:2:nan", f"log.interval={interval}")
        train_job(cfg, LaunchSpec(nproc=2))
        runs[interval] = (cfg, run_dir)
    assert "non-finite loss or gradient at step 2; update skipped (1 so far)" in capfd.readouterr().err
    rows = {m["step"]: m for m in metrics(runs[3][1]) if "loss" in m}
    assert sorted(rows) == [3, 6] and rows[3]["nonfinite_skips"] == 1
    final = [weights(cfg, d / "checkpoints" / "step-00000006") for cfg, d in runs.values()]
    assert_same(final[0], final[1])
    run_dir = tmp_path / "two-in-a-row"
    cfg = tiny_config(token_dir, run_dir, *JOB, "fault.inject=0:4:nan,1:5:nan", "fault.max_nonfinite=2",
                      "log.interval=3", "checkpoint.interval=3")
    with pytest.raises(LaunchError, match=r"non-finite loss or gradient in 2 steps in a row up to step 5"):
        train_job(cfg, LaunchSpec(nproc=2))
    assert [s for s, _ in committed(run_dir / "checkpoints")] == [3]  # nothing after the bad steps


def test_nan_skip_counts_continues_and_stops_after_n_in_a_row(token_dir, tmp_path):
    # Steps 2 and 4 are skipped with a good step between them; step 5 is the 2nd bad one in a row.
    run_dir = tmp_path / "run"
    cfg = tiny_config(token_dir, run_dir, *JOB, "fault.inject=0:2:nan,0:4:nan,1:5:nan",
                      "fault.max_nonfinite=2", "fault.max_restarts=2")
    with pytest.raises(LaunchError, match=r"NonFiniteError: non-finite loss or gradient in 2 steps in a "
                                          r"row up to step 5 \(fault.max_nonfinite=2\)"):
        train_job(cfg, LaunchSpec(nproc=2))
    assert [e["verdict"] for e in restarts(run_dir)] == ["fatal"]  # a diverged run is not restarted
    rows = [m for m in metrics(run_dir) if "loss" in m]
    assert [m["nonfinite_skips"] for m in rows] == [0, 1, 1, 2]
    assert [s for s, _ in committed(run_dir / "checkpoints")] == [2, 4]  # the save in flight committed
    model = build_reference_model(cfg, 257)
    for step in (2, 4):
        load_weights(model, run_dir / "checkpoints" / f"step-{step:08d}")
        assert all(torch.isfinite(p).all() for p in model.parameters())


def _make_unwritable(path: Path) -> bool:
    """chmod for ordinary users; root ignores modes, so chattr +i (immutable) there."""
    path.chmod(0o555)
    probe = path / ".probe"
    try:
        probe.touch()
    except OSError:
        return True
    probe.unlink()
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def test_unwritable_checkpoint_directory_keeps_training_and_the_previous_checkpoint(
        token_dir, tmp_path, capfd):
    run_dir = tmp_path / "run"
    train_job(tiny_config(token_dir, run_dir, *JOB, "run.steps=2"), LaunchSpec(nproc=2))
    ckpts = run_dir / "checkpoints"
    before = (ckpts / "step-00000002" / "__0_0.distcp").read_bytes()
    if not _make_unwritable(ckpts):
        pytest.skip("cannot make a directory unwritable here")
    try:
        with pytest.raises(LaunchError, match=r"CheckpointError: the final checkpoint \(step 6\) was not "
                                              r"saved; the last committed one is intact"):
            train_job(tiny_config(token_dir, run_dir, *JOB), LaunchSpec(nproc=2), resume=str(run_dir))
    finally:
        subprocess.run(["chattr", "-i", str(ckpts)], capture_output=True)
        ckpts.chmod(0o755)
    err = capfd.readouterr().err
    warns = [line for line in err.splitlines() if "was not saved" in line and "warning" in line]
    assert len(warns) == 2, err  # steps 4 and 6 each named once, and training went on
    assert "Permission denied" in warns[0] or "Operation not permitted" in warns[0], warns[0]
    assert [m["step"] for m in metrics(run_dir) if "loss" in m][-1] == 6
    events = [m for m in metrics(run_dir) if "loss" not in m and "checkpoint_failures" in m]
    assert [m["checkpoint_failures"] for m in events] == [1, 2]  # each failure logged as it surfaced
    assert [s for s, _ in committed(ckpts)] == [2]
    verify_manifest(ckpts / "step-00000002")
    assert (ckpts / "step-00000002" / "__0_0.distcp").read_bytes() == before


def _recording_data(cfg):
    """The token dataset, logging every index this rank reads to RUN_DIR/seen/rank-R."""
    from allhands.data import load_token_splits

    train, _, _ = load_token_splits(cfg.data.path, cfg.model.seq_len)
    return _Recorder(train, Path(cfg.run.dir) / "seen" / f"rank-{os.environ['RANK']}")


class _Recorder(torch.utils.data.Dataset):
    def __init__(self, inner, path: Path):
        self.inner, self.path = inner, path
        path.parent.mkdir(parents=True, exist_ok=True)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return self.inner[i]


def _steps_seen(run_dir: Path, world: int, per_step: int) -> list[list[int]]:
    """Global batch of each step, rebuilt from the ranks' logs (rank r holds the r-th slice)."""
    logs = [[int(x) for x in (run_dir / "seen" / f"rank-{r}").read_text().split()] for r in range(world)]
    local = per_step // world
    steps = len(logs[0]) // local
    return [sum((log[s * local:(s + 1) * local] for log in logs), []) for s in range(steps)]


@pytest.mark.parametrize("saved, resumed", [(2, (1, 3)), (4, (2,))], ids=["2->1,3", "4->2"])
def test_resume_at_another_world_size_sees_the_same_data_and_parameters(token_dir, tmp_path, saved, resumed):
    # The cases 2 -> 1, 2 -> 3 and 4 -> 2: the same global batches in the same order after
    # the resume, and parameters within float tolerance (the reduction order differs).
    job = Job(data=_recording_data)
    full = tmp_path / "full"
    cfg = tiny_config(token_dir, full, *JOB, "checkpoint.interval=3", "data.eval_batches=0",
                      "model.vocab_size=257")
    train_job(cfg, LaunchSpec(nproc=saved), job=job)
    batch = cfg.run.global_batch
    reference = _steps_seen(full, saved, batch)
    assert len(reference) == 6
    a = weights(cfg, full / "checkpoints" / "step-00000006")
    for world in resumed:
        cut = tmp_path / f"cut{world}"
        shutil.copytree(full, cut)
        shutil.rmtree(cut / "checkpoints" / "step-00000006")
        shutil.rmtree(cut / "seen")
        train_job(cfg, LaunchSpec(nproc=world), job=job, resume=str(cut))
        assert _steps_seen(cut, world, batch) == reference[3:6], f"{saved} -> {world}: other data"
        assert_same(a, weights(cfg, cut / "checkpoints" / "step-00000006"), exact=False)


def test_drill_prints_a_table_and_the_final_parameters_match(token_dir, tmp_path, capfd):
    sets = [f"--set={s}" for s in (*TINY, "run.steps=5", "checkpoint.interval=2", "fault.backoff_s=0.1",
                                   f"data.path={token_dir}", f"run.dir={tmp_path / 'drill'}")]
    r = cli(["drill", "--nproc", "2", "--faults", "1", "--seed", "4", *sets], capfd)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    spec = out[0].split("fault.inject=")[1]
    assert out[1].split() == ["fault", "(rank:step:kind)", "detect", "s", "recover", "s", "resumed", "at",
                              "recomputed"]
    fault, detect, recover, resumed, recomputed = out[2].split()
    assert fault == spec and float(detect) < float(recover) and int(resumed) in (0, 2, 4)
    assert int(recomputed) >= 0
    assert "final parameters EQUAL to the undisturbed run's" in out[3]


@pytest.mark.serial  # times sleeps to 0.1 s
def test_slow_fault_makes_steps_take_factor_times_their_work(tmp_path):
    for bad in ("0:1:slow=1", "0:1:slow=x", "0:1:slow="):
        with pytest.raises(ConfigError, match="^fault.inject"):
            parse_faults(bad)
    slow, other = FaultInjector("0:2:slow=3", 0, tmp_path), FaultInjector("0:2:slow=3", 1, tmp_path)
    waits = []
    for step in range(1, 5):
        t0 = time.perf_counter()
        slow.before_step(step)
        other.before_step(step)
        waits.append(time.perf_counter() - t0)
        time.sleep(0.05)  # the step's work
    assert max(waits[:2]) < 0.02  # steps 1 and 2 ran at full speed (step 2's work is slowed after it)
    assert all(0.1 <= w < 0.2 for w in waits[2:]), waits  # 2 x the 0.05 s of work
    assert not (tmp_path / "faults").exists()  # a straggler is not a fire-once fault
