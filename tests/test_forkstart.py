"""Workers forked from the launcher's preloaded forkserver (launch/forkstart.py) start as spawned
ones did: in the launcher's environment as it is at the start (not as it was when the server
started), with its umask, stdout and stderr, temporary directory and thread setting and no blocked
signal, knowing their launcher; the server outlives a stop signal to the process group, and goes with
the workers when the launcher is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import forkserver
from pathlib import Path

import pytest
import torch

from allhands import safefs
from allhands.launch import forkstart
from allhands.launch.launcher import LaunchSpec, launch

from conftest import ROOT


def probe(out: str) -> None:
    """A worker's entry point: what it started with, as JSON."""
    info = {"env": {k: v for k, v in os.environ.items() if k.startswith(("ALLHANDS_", "TMPDIR", "RANK"))},
            "tmp": tempfile.gettempdir(), "threads": torch.get_num_threads(), "ppid": os.getppid(),
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "alive_fd": forkserver._forkserver._forkserver_alive_fd,
            "umask": next(line.split()[1] for line in open("/proc/self/status") if line.startswith("Umask:"))}
    Path(out, f"rank-{os.environ['RANK']}.json").write_text(json.dumps(info))
    print(f"probe rank {os.environ['RANK']}", file=sys.stderr, flush=True)


def test_a_forked_worker_starts_in_the_launchers_environment_of_now(tmp_path, monkeypatch):
    forkserver._forkserver._stop()  # a fresh server, started with the variables and umask below
    monkeypatch.setenv("ALLHANDS_TEST_DROPPED", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    umask = os.umask(0o022)
    try:
        assert forkstart.ensure_server() == "forkserver"
    finally:
        os.umask(umask)
    monkeypatch.delenv("ALLHANDS_TEST_DROPPED")
    monkeypatch.setenv("ALLHANDS_TEST_ADDED", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    saved = os.dup(2)
    with open(tmp_path / "stderr", "w") as err:  # the launcher's stderr, since the server started
        os.dup2(err.fileno(), 2)
        try:
            launch(probe, (str(tmp_path),), LaunchSpec(nproc=2))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    said = (tmp_path / "stderr").read_text()
    assert "probe rank 0" in said and "probe rank 1" in said, said
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for r, info in enumerate(ranks):
        env = info["env"]
        assert env["RANK"] == str(r)  # torch's own variables win
        assert env["ALLHANDS_TEST_ADDED"] == "2" and "ALLHANDS_TEST_DROPPED" not in env
        assert int(info["umask"], 8) == safefs.PRIVATE_UMASK != 0o022  # launch()'s, not the server's
        assert env["ALLHANDS_LAUNCHER_PID"] == str(os.getpid())
        assert info["ppid"] == forkstart._server_pid[0]  # forked by the server, not spawned
        assert info["tmp"] == env["TMPDIR"] and env["TMPDIR"] != os.environ.get("TMPDIR")  # private_tmp's
        assert info["threads"] == 2
        assert not set(info["blocked"]) & {int(s) for s in forkstart.SHIELDED}
        assert info["alive_fd"] is None


def descendants(pid: int) -> dict[int, int]:
    """``{process: its parent}`` of every process under ``pid`` (from /proc)."""
    parent = {}
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except (OSError, ValueError):
            continue
        if d.name.isdigit():
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = {}, [pid]
    while todo:
        of = todo.pop()
        kids = [c for c, p in parent.items() if p == of]
        out.update((k, of) for k in kids)
        todo.extend(kids)
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sleeper(out: str) -> None:
    """A worker's entry point that waits, needing nothing of its launcher, until it is killed."""
    Path(out, f"rank-{os.environ['RANK']}").touch()
    time.sleep(600)


@pytest.mark.parametrize("own", [False, True], ids=["spawned-server", "forked-server"])
def test_the_server_and_the_workers_go_with_a_sigkilled_launcher(tmp_path, cli_env, own):
    """Spawned (a process not allhands' own: a script, a notebook) or forked (the command's own
    process, launch/owner.py), the server goes with a SIGKILLed launcher; a forked one holds
    none of the launcher's descriptors (here a file it opened first) and never exec'd."""
    code = (f"import sys; held = open({str(tmp_path / 'held')!r}, 'w'); from test_forkstart import sleeper; "
            "from allhands.launch import owner; from allhands.launch.launcher import LaunchSpec, launch; "
            + ("owner.mark_own(); " if own else "")
            + f"launch(sleeper, ({str(tmp_path)!r},), LaunchSpec(nproc=2))")
    p = subprocess.Popen([sys.executable, "-c", code], env=cli_env, cwd=ROOT / "tests",
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank-{r}").exists() for r in (0, 1)):
        assert p.poll() is None and time.monotonic() < deadline, \
            (p.kill(), p.communicate(timeout=60))  # killed first: past the deadline it still runs
        time.sleep(0.1)
    below = descendants(p.pid)
    server = [c for c, up in below.items() if up == p.pid and list(below.values()).count(c) == 2]
    assert len(server) == 1  # the server and its 2 workers
    cmdline = Path(f"/proc/{server[0]}/cmdline").read_bytes()
    if own:
        assert cmdline == Path(f"/proc/{p.pid}/cmdline").read_bytes()  # forked from the launcher
        held = [os.readlink(f) for f in Path(f"/proc/{server[0]}/fd").iterdir()]
        assert str(tmp_path / "held") not in held and \
            str(tmp_path / "held") in [os.readlink(f) for f in Path(f"/proc/{p.pid}/fd").iterdir()]
        assert all(h.startswith(("socket:", "pipe:", "anon_inode:", "/dev/")) or h in
                   [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in (0, 1, 2)] for h in held), held
    else:
        assert b"forkserver" in cmdline
    for sig in forkstart.SHIELDED:  # as a signal to the whole process group would reach it
        os.kill(server[0], sig)
    time.sleep(0.5)
    assert alive(server[0]) and p.poll() is None
    p.kill()
    p.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(alive(c) for c in below):
        assert time.monotonic() < deadline, f"left running: {[c for c in below if alive(c)]}"
        time.sleep(0.1)


def test_the_cli_called_in_process_does_not_make_the_process_ours(capsys):
    """``main(argv)`` from a test runner or a script leaves the caller's process as it was: its
    later launches spawn their server rather than fork one carrying the caller's state."""
    from allhands import cli
    from allhands.launch import owner

    assert cli.main(["config", "show"]) == 0
    assert not owner.is_own()
