"""The user next door: another unprivileged user on the same host attacks a job run by this one.

The attacker runs as a user made for the test (``useradd``, removed afterwards; ``setuid`` in the child) with the system
Python; these tests need root for that and are skipped otherwise. Files: the shared temporary
directory, run directories, secret files.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import re
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from allhands import safefs
from allhands.admission import job_secret
from allhands.errors import ConfigError
from allhands.launch.rundir import resolve_run

from conftest import ALLHANDS, ROOT, tiny_config

ROOTLESS = os.geteuid() != 0 or shutil.which("useradd") is None
needs_root = pytest.mark.skipif(ROOTLESS, reason="needs root (to create the attacking user) and "
                                                 "useradd")
SYSTEM_PYTHON = shutil.which("python3.11", path="/usr/bin:/bin") or "/usr/bin/python3"


@pytest.fixture(scope="module")
def stranger():
    """An unprivileged user that is not the job's: ``(name, uid, gid)``."""
    if ROOTLESS:
        pytest.skip("needs root")
    name = f"ahx{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "-M", "-r", "-s", "/usr/sbin/nologin", name], check=True, timeout=60)
    try:
        pw = pwd.getpwnam(name)
        yield name, pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", name], check=False, timeout=60)


def as_user(user: tuple[str, int, int], args: list[str], **kw) -> subprocess.Popen:
    """Run ``args`` as ``user`` (a direct child, so that killing it kills the attacker)."""
    _, uid, gid = user

    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    env = {"PATH": "/usr/bin:/bin", "HOME": "/", **kw.pop("env", {})}
    return subprocess.Popen(args, cwd="/", text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=drop, env=env, **kw)


# --------------------------------------------------------------------------- temporary files


@needs_root
def test_a_payload_planted_in_the_shared_temp_directory_never_runs(stranger, tmp_path, cli_env):
    """The attacker watches the shared temporary directory with inotify and re-creates each of
    torch's worker error files (created, unlinked, later unpickled if the worker failed) with a
    pickle whose load runs a command. A job whose workers fail must never load it: its
    temporary files are in a directory of its own, which the attacker never sees."""
    # A shared directory of the test's own (sticky, writable by all, as /tmp): an attacker in the
    # real /tmp would also plant payloads for every other job on the machine.
    shared = Path(tempfile.mkdtemp(prefix="ahx-shared-", dir="/tmp"))
    shared.chmod(0o1777)
    marker = tmp_path / "payload-ran"
    watcher = as_user(stranger, [SYSTEM_PYTHON, str(ROOT / "tests/scripts/tmp_watcher.py"),
                                    str(shared), str(marker)])
    try:
        assert watcher.stdout.readline().strip() == "watching", watcher.stderr.read()
        # Workers that fail (exit code 3) make torch's spawner read their error files.
        job = ("import sys; from allhands.launch.launcher import LaunchSpec, launch; "
               "launch(sys.exit, (3,), LaunchSpec(nproc=2))")
        run = subprocess.Popen([sys.executable, "-c", job], env={**cli_env, "TMPDIR": str(shared)},
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        err = run.communicate(timeout=180)[1]
        time.sleep(0.5)
    finally:
        watcher.kill()
        shutil.rmtree(shared, ignore_errors=True)
    seen = watcher.communicate(timeout=60)[0]
    assert run.returncode == 1 and "exited with code 3" in err, err[-3000:]
    assert not marker.exists(), "the planted pickle was loaded"
    assert "saw" not in seen, f"the job's temporary files were in the shared directory: {seen}"
    assert f"allhands-{os.geteuid()}-{run.pid}-" not in seen, "its private directory was left"


def test_private_tmp_is_private_and_removed_and_stale_ones_are_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"allhands-{os.geteuid()}-killed"  # a killed launcher's: nobody holds it
    stale.mkdir()
    (stale / "attempt-0").mkdir()
    alive = tmp_path / f"allhands-{os.geteuid()}-running"  # a running launcher's
    alive.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; "
                               f"fd = os.open({str(alive)!r}, os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    with safefs.private_tmp() as private:
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert tempfile.gettempdir() == str(private) == os.environ["TMPDIR"]
        assert not stale.exists() and alive.exists()
        assert safefs.sweep_stale(tmp_path) == []  # this job's own directory is held too
    holder.communicate("", timeout=60)
    assert not private.exists() and tempfile.gettempdir() == str(tmp_path)


def test_a_sweep_landing_while_another_launcher_makes_its_directory_leaves_it(tmp_path, monkeypatch):
    """Replica groups start their launchers at once: one's sweep can run between another's
    making its private directory and locking it. Here every directory made is swept at once
    (another launcher's sweep, at the worst moment): the directory being made survives."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = tempfile.mkdtemp

    def made_then_swept(*args, **kwargs):
        path = made(*args, **kwargs)
        safefs.sweep_stale(tmp_path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", made_then_swept)
    with safefs.private_tmp() as private:
        assert private.is_dir() and private.name.startswith(f"allhands-{os.geteuid()}-")
        monkeypatch.setattr(tempfile, "mkdtemp", made)
        assert safefs.sweep_stale(tmp_path) == [] and private.is_dir()
    assert not private.exists() and os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- run directories


def test_run_directory_and_files_are_the_users_alone(token_dir, tmp_path):
    cfg = resolve_run(tiny_config(token_dir, tmp_path / "run"), resume=None, world_size=1)
    run = Path(cfg.run.dir)
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "config.resolved.toml").stat().st_mode) == 0o600
    with safefs.private_umask():
        (run / "sub").mkdir()
    assert stat.S_IMODE((run / "sub").stat().st_mode) == 0o700


def test_a_symlinked_run_directory_file_is_not_followed(token_dir, tmp_path):
    """``config.resolved.toml`` linked to a file the job may write: the write fails, the file
    it points at is untouched."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run / "config.resolved.toml").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"^run\.dir: cannot write .*symbolic links"):
        resolve_run(tiny_config(token_dir, run), resume=None, world_size=1)
    assert victim.read_text() == "precious\n"
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        safefs.open_private(run / "metrics.jsonl", "a")
    assert victim.read_text() == "precious\n"


@needs_root
def test_a_run_directory_of_another_user_is_refused_in_one_line(stranger, token_dir, tmp_path):
    run = tmp_path / "theirs"
    run.mkdir(mode=0o755)
    os.chown(run, stranger[1], stranger[2])
    with pytest.raises(ConfigError, match=r"^run\.dir: .* belongs to uid \d+, not to this user") as e:
        resolve_run(tiny_config(token_dir, run), resume=None, world_size=1)
    assert "\n" not in str(e.value)
    assert not (run / "config.resolved.toml").exists()


def test_a_run_directory_others_may_write_is_refused(token_dir, tmp_path):
    run = tmp_path / "open"
    run.mkdir()
    run.chmod(0o777)
    with pytest.raises(ConfigError, match=r"^run\.dir: .* is writable by other users \(mode 777\)"):
        resolve_run(tiny_config(token_dir, run), resume=None, world_size=1)


# --------------------------------------------------------------------------- secret files


@needs_root
def test_a_secret_file_of_another_user_is_refused(stranger, tmp_path):
    path = tmp_path / "job.secret"
    path.write_text("x" * 32)
    path.chmod(0o600)
    os.chown(path, stranger[1], stranger[2])
    with pytest.raises(ConfigError, match=r"^--secret-file: .* belongs to uid \d+, not to this user"):
        job_secret(multi_node=True, secret_file=str(path), insecure=False, env={})


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_secret_file_others_may_read_or_write_is_refused(tmp_path, mode):
    path = tmp_path / "job.secret"
    path.write_text("x" * 32)
    path.chmod(mode)
    with pytest.raises(ConfigError, match=rf"^ALLHANDS_SECRET_FILE: .* \(mode {mode:o}\); run `chmod 600"):
        job_secret(multi_node=True, secret_file="", insecure=False,
                   env={"ALLHANDS_SECRET_FILE": str(path)})
    path.chmod(0o600)
    assert job_secret(multi_node=True, secret_file=str(path), insecure=False, env={}) == "x" * 32


# --------------------------------------------------------------------------- the stores

SITE = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"), None)
FORGER = str(ROOT / "tests/scripts/store_forger.py")


def strike(job: list[subprocess.Popen], out: Path, forger, what: str,
           addr: str = r"127\.0\.0\.1") -> tuple[subprocess.Popen, str]:
    """Attack ``job`` (``allhands launch`` of tests/scripts/store_job.py; its first process names
    the stores) with tests/scripts/store_forger.py ``what``, started by ``forger(port)`` as soon
    as the store it targets is named (so its start-up overlaps the job's). Records in the worker
    store: written once the workers were admitted and wait, read by the process group they then
    make (``go``). The rendezvous state: written once there is one (the job starting), read by
    the launchers' next keep-alive, or a joining node. Returns the attacker and what it said it
    wrote."""
    lines = []
    for line in job[0].stderr:
        lines.append(line)
        if line.startswith("allhands: listening on"):
            break
    ports = {kind: int(port) for port, kind in
             re.findall(addr + r":(\d+) \((rendezvous store|worker store)", "".join(lines[-1:]))}
    assert len(ports) == 2, "".join(lines)[-3000:]
    attacker = forger(ports["rendezvous store" if what == "state" else "worker store"])
    assert attacker.stdout.readline().strip() == "connected", \
        (attacker.kill(), attacker.communicate(timeout=60)[1][-3000:])  # killed first: it may still run
    deadline = time.monotonic() + 120
    while what != "state" and not all((out / f"ready{r}").exists() for r in (0, 1)):
        for proc in job:
            assert proc.poll() is None and time.monotonic() < deadline, \
                (proc.kill(), proc.communicate(timeout=60)[1][-3000:])  # killed first: past the deadline it still runs
        time.sleep(0.1)
    attacker.stdin.write("strike\n")
    attacker.stdin.flush()
    said = attacker.stdout.readline()
    if what != "state":
        (out / "go").touch()
    return attacker, said


def _attacked_job(stranger, out: Path, cli_env: dict, what: str):
    """A single-host job of 2 workers attacked by ``stranger`` (see :func:`strike`)."""
    out.mkdir()
    job = subprocess.Popen([*ALLHANDS, "launch", "--nproc", "2", "tests/scripts/store_job.py",
                            str(out)], env=cli_env, cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        attacker, said = strike([job], out, lambda port: as_user(
            stranger, [SYSTEM_PYTHON, FORGER, "127.0.0.1", str(port), what],
            env={"PYTHONPATH": str(SITE)}, stdin=subprocess.PIPE), what)
        err = job.communicate(timeout=120)[1]
    finally:
        (out / "go").touch()
        job.kill()
    return job, err, said, attacker.communicate(timeout=30)[0]  # closes its stdin first


def undisturbed_or_stopped(jobs: list[subprocess.Popen], errs: list[str], out: Path) -> None:
    """Either the job stopped (each launcher: exit 1 and one error line, one of them naming the
    intrusion; no rank's result), or it computed with its own members only (each rank's
    all_reduce of rank + 1 is 3)."""
    results = [json.loads(p.read_text())["sum"] for p in sorted(out.glob("rank*.json"))]
    codes = [job.returncode for job in jobs]
    if codes == [0] * len(jobs):
        assert results == [3.0, 3.0], (results, errs)
        return
    assert not results and codes == [1] * len(jobs), (codes, results, [e[-3000:] for e in errs])
    lines = [[ln for ln in err.splitlines() if ln.startswith("allhands: error:")] for err in errs]
    assert all(len(said) == 1 for said in lines), "\n=====\n".join(errs)
    assert any("intrusion: refused key" in said[0] for said in lines), lines


INTRUSION = (r"allhands: intrusion: refused key '{key}' in the {store} at {addr}:\d+: its value "
             r"has no valid MAC")


@needs_root
def test_forged_gloo_connection_records_are_refused(stranger, tmp_path, cli_env):
    """The relay attack's first step: overwrite (here: plant, before gloo writes them) the
    connection records of a process group with another address. Every record read carries a
    MAC under the job secret, so the forged ones are refused and named, and no rank computes
    with a peer it did not verify."""
    out = tmp_path / "out"
    job, err, said, _ = _attacked_job(stranger, out, cli_env, "gloo")
    assert said.startswith("forged"), said
    assert re.search(INTRUSION.format(key=r"0//\d+//cpu//0/1", store="worker store",
                                      addr=r"127\.0\.0\.1"), err), err[-3000:]
    undisturbed_or_stopped([job], [err], out)


@needs_root
def test_a_forged_admission_record_is_refused(stranger, tmp_path, cli_env):
    """The stranger's bid to join: its own listener as rank 1's connection record of the job's
    next process group (allhands' own admission proofs travel over the process group, so this
    record is the only admission step in a store). Refused and named; nobody dials the
    stranger."""
    out = tmp_path / "out"
    job, err, said, after = _attacked_job(stranger, out, cli_env, "admit")
    assert said.startswith("forged") and "admission records as rank 1" in said, said
    assert re.search(INTRUSION.format(key=r"0//\d+//cpu//0/1", store="worker store",
                                      addr=r"127\.0\.0\.1"), err), err[-3000:]
    assert after.strip() == "never dialled", after
    undisturbed_or_stopped([job], [err], out)


@needs_root
def test_a_forged_rendezvous_state_is_refused(stranger, tmp_path, cli_env):
    """A well-formed state with a fake node on the wait list made torch's agent restart every
    worker, silently; its MAC is missing, so the launcher refuses it and stops in one line."""
    out = tmp_path / "out"
    job, err, said, _ = _attacked_job(stranger, out, cli_env, "state")
    assert said.startswith("forged the rendezvous state"), said
    assert job.returncode == 1, err[-3000:]
    assert re.search(INTRUSION.format(key=r"torch\.rendezvous\.\w+", store="rendezvous store",
                                      addr=r"127\.0\.0\.1"), err), err[-3000:]
    assert "waiting to join" not in err and "Traceback" not in err
