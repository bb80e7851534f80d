"""tests/zygote.py: a command a test starts as a fork of the test zygote is the process a new
interpreter would be: what it sees, what it prints, how it ends, how signals reach it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import zygote
from conftest import ALLHANDS, ROOT

SCRIPT = str(ROOT / "tests" / "scripts" / "observe.py")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def both(monkeypatch, args: list[str], **kw) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """``args`` run as a fork of the zygote, then by a new interpreter (the zygote off)."""
    assert zygote.SERVER.routable(args, kw), args
    forked = subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)
    with monkeypatch.context() as m:
        m.setenv("ALLHANDS_TEST_ZYGOTE", "0")
        fresh = subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)
    return forked, fresh


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "-u"])
def test_a_forked_script_sees_what_a_new_interpreter_sees(tmp_path, monkeypatch, unbuffered):
    env = dict(os.environ, ZYGOTE_PROBE="seen", TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    os.chmod(tmp_path, 0o750)
    forked, fresh = both(monkeypatch, [sys.executable, *(["-u"] if unbuffered else []), SCRIPT, "observe"],
                         env=env, cwd=tmp_path, input="from stdin")
    assert forked.returncode == fresh.returncode == 0, (forked.stderr, fresh.stderr)
    seen = json.loads(forked.stdout)
    assert seen == json.loads(fresh.stdout)
    assert seen["probe"] == "seen" and seen["tmp"] == str(tmp_path) and seen["cwd"] == str(tmp_path)
    assert seen["stdin"] == "from stdin" and seen["threads"] == 1 and not seen["own_session"]


@pytest.mark.parametrize("how", [["exit", "3"], ["exit", "a message"], ["raise"], ["interrupt"]],
                         ids=["exit-3", "exit-message", "raise", "interrupt"])
def test_a_forked_script_ends_as_a_new_interpreter_ends(monkeypatch, how):
    forked, fresh = both(monkeypatch, [sys.executable, SCRIPT, *how], cwd=ROOT)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == {"exit": 3 if how[-1] == "3" else 1, "raise": 1, "interrupt": -signal.SIGINT}[how[0]]


def test_the_command_answers_as_a_new_interpreter(monkeypatch, cli_env):
    for argv in (["--help"], ["train", "--set", "optim.lr=-3"], ["no-such-command"]):
        forked, fresh = both(monkeypatch, [*ALLHANDS, *argv], env=cli_env, cwd=ROOT)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_forked_command_is_a_real_process_in_its_own_session(cli_env, tmp_path, sig):
    """The pid is the command's (a child of the zygote, not of the test), its session exists
    when Popen returns, signals reach it and its exit status comes back through Popen."""
    args = [*ALLHANDS, "rendezvous-store", "--bind", "127.0.0.1", "--port", "0"]
    p = subprocess.Popen(args, env=cli_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        assert parent_of(p.pid) == zygote.SERVER.proc.pid
        assert os.getsid(p.pid) == p.pid and os.getpgid(p.pid) == p.pid
        assert os.readlink(f"/proc/{p.pid}/cwd") == str(tmp_path)
        assert p.stdout.readline().startswith("allhands: listening on 127.0.0.1:")
        assert p.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=0.2)
        p.send_signal(sig)
        out = p.communicate(timeout=60)[0]
    finally:
        p.kill()
        p.wait(60)
    if sig == signal.SIGKILL:
        assert p.returncode == -signal.SIGKILL
    else:  # the command's own clean stop
        assert p.returncode == 0 and "rendezvous store stopped" in out, (p.returncode, out)


def test_what_a_fork_cannot_reproduce_starts_a_new_interpreter(tmp_path):
    server = zygote.SERVER
    assert server.routable([*ALLHANDS, "--help"], {})
    assert not server.routable([sys.executable, "-c", "pass"], {})  # code whose imports a test checks
    assert not server.routable([*ALLHANDS, "--help"], {"preexec_fn": os.getpid})
    assert not server.routable([*ALLHANDS, "--help"], {"env": {**os.environ, "PYTHONHASHSEED": "7"}})
    assert not server.routable([*ALLHANDS, "--help"], {"env": {**os.environ, "LD_PRELOAD": "x.so"}})
    # the chaos checker finds a job's processes by this tag in /proc/PID/environ
    assert not server.routable([*ALLHANDS, "--help"], {"env": {**os.environ, "ALLHANDS_CHAOS_TAG": "t"}})
    (tmp_path / "sitecustomize.py").write_text("")
    assert not server.routable([*ALLHANDS, "--help"], {"cwd": tmp_path})
