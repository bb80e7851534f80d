"""The modes beyond lock-step under a stranger who reaches their stores: the replica groups'
quorum store (with a spare, through a SIGKILL's recovery) and the parameter server's link store
(fault.mode=replica). Each job is `allhands train`, as a user starts it; while it runs, the test
reads which sockets its processes listen on (/proc, as test_security_network.py) and, as
another local process without the job secret, forges the keys the mode decides on (created,
overwritten, voted ahead) and sends malformed frames. The job must finish every step with the
parameters it has undisturbed, name each forged key, and print no C++ stack trace.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import stat
import struct
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import ALLHANDS, ROOT, TINY, tiny_config
from test_parity import max_rel_diff, reference_params, trained_params
from test_security_network import _descendants, _listeners

from allhands.errors import LaunchError
from allhands.job import build_reference_model
from allhands.launch.replicas import check_groups, see_logs


_SEALED = 48  # MAC and nonce ahead of every value: a stranger reads the value behind them


def _garbage(port: int) -> None:
    """Malformed frames, as a stranger's client sends them: an oversized key length, an
    oversized value length, a truncated key (TCPStore's wire format: a command byte, then
    64-bit lengths)."""
    hello = b"\x00" + struct.pack("<I", 0x3C85F7CE)  # the store's validation frame
    for frame in (b"\x01" + struct.pack("<Q", 2 ** 40) + b"key",
                  b"\x01" + struct.pack("<Q", 1) + b"k" + struct.pack("<Q", 2 ** 50),
                  b"\x03" + struct.pack("<Q", 9) + b"ab"):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(hello + frame)
            time.sleep(0.1)


class Job:
    """`allhands train` in a subprocess: its stderr collected by a thread, the store's port
    taken from the launcher's line, and the listeners of its processes sampled while it runs."""

    def __init__(self, sets: list[str], env: dict, store_line: str):
        cmd = [*ALLHANDS, "train", "--nproc", sets.pop(0)] + [a for s in sets for a in ("--set", s)]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self.port: int | None = None
        self.listening: set[tuple[str, int, int]] = set()
        self._pattern = re.compile(store_line + r" on 127\.0\.0\.1:(\d+) only")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = self._pattern.search(line)
            if m:
                self.port = int(m.group(1))

    def store(self) -> dist.TCPStore:
        deadline = time.monotonic() + 180
        while self.port is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)[-3000:]
            time.sleep(0.05)
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=10))

    def sample(self) -> None:
        self.listening |= set(_listeners(_descendants(self.proc.pid)))

    def finish(self, timeout: float = 400) -> str:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.proc.kill()
        time.sleep(0.2)
        return "".join(self.lines)


def _read_store(what, job: Job):
    """``what()``; when the store is gone the job has ended or its store host died: the
    failure shows the job's own lines, not the client's C++ stack."""
    try:
        return what()
    except dist.DistNetworkError as e:
        try:
            job.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        raise AssertionError(f"the job's store went away ({e.__class__.__name__}); job exit "
                             f"{job.proc.poll()}:\n" + "".join(job.lines)[-4000:]) from None


def _until(what, job: Job, timeout: float = 180, sample: bool = True):
    deadline, sampled = time.monotonic() + timeout, 0.0
    while not (got := _read_store(what, job)):
        assert job.proc.poll() is None and time.monotonic() < deadline, "".join(job.lines)[-3000:]
        if sample and time.monotonic() - sampled > 0.5:  # reading /proc is slow: the strike must not wait
            job.sample()
            sampled = time.monotonic()
        time.sleep(0.005)
    return got


def _first_change(job: Job, key: str, forged: bytes) -> list[bytes]:
    """The first bytes of ``key`` other than ``forged`` (a list a watcher thread fills; its own
    client, so the strike is not delayed)."""
    got: list[bytes] = []
    store = dist.TCPStore("127.0.0.1", job.port, is_master=False, timeout=timedelta(seconds=10))

    def watch() -> None:
        try:
            while job.proc.poll() is None and (value := store.get(key)) == forged:
                time.sleep(0.002)
            got.append(value)
        except Exception:  # the store went away with the job
            pass

    threading.Thread(target=watch, daemon=True).start()
    return got


def _steps(raw: dist.TCPStore) -> list[tuple[int, int]]:
    """(quorum, step) of the votes in the store now: the steps being reduced."""
    return [(int(m[1]), int(m[2])) for k in raw.list_keys() if (m := re.match(r"ok/(\d+)/(\d+)/", k))]


def _sets(token_dir: Path, run: Path, *extra: str) -> list[str]:
    return [*TINY, f"data.path={token_dir}", f"run.dir={run}", "run.threads=1", *extra]


def _assert_private(run: Path, dirs: list[str], files: list[str]) -> None:
    for name, mode in [*((d, 0o700) for d in dirs), *((f, 0o600) for f in files)]:
        got = stat.S_IMODE((run / name).stat().st_mode)
        assert got == mode, f"{name}: mode {got:o}, not {mode:o}"


def _assert_told(out: str, keys: list[str], processes: int) -> None:
    """Each forged key named (once per process that read it, at most), no C++ trace in the log,
    and the malformed frames said in allhands' own line."""
    for key in keys:
        n = out.count(f"intrusion: ignored key {key!r}")
        assert 1 <= n <= processes, (key, n, out[-4000:])
    assert "dropped a malformed frame" in out, out[-3000:]
    assert "frame #" not in out and "Exception raised from" not in out, out[-3000:]


def _assert_loopback(job: Job, at_least: int) -> None:
    ports = {port for _, port, _ in job.listening}
    assert job.port in ports and len(job.listening) >= at_least, job.listening
    bad = [e for e in job.listening if not ipaddress.ip_address(e[0]).is_loopback]
    assert not bad, f"listening beyond loopback: {bad}"


def test_replica_job_with_a_spare_under_forged_votes_joins_deaths_and_done(token_dir, tmp_path, cli_env):
    """Two groups and a spare; group 1 is SIGKILLed at step 8 of 20 and the spare takes its
    place. From the first quorum on, the stranger creates ``done`` and ``stop``, a death notice
    of the live group 0, a hand-over to the spare and the next quorum; overwrites ``epoch``,
    ``joiners`` and ``life/0``; votes the next steps ``abort``; sends malformed frames; and after
    the kill votes ahead in the new quorum and overwrites ``life/1``."""
    run = tmp_path / "run"
    job = Job(["2", *_sets(token_dir, run, "run.steps=20", "fault.mode=replica", "fault.spares=1",
                            "fault.max_restarts=1", "fault.inject=1:8:SIGKILL,0:9:slow=40", "parallel.timeout_s=60",
                            "fault.quorum_timeout_s=0.5", "fault.min_groups=2")],
              cli_env, "quorum store")
    raw = job.store()
    _until(lambda: raw.check(["epoch", "life/0", "life/1"]) and _steps(raw), job)
    epoch = int(raw.get("epoch")[_SEALED:])
    life0 = raw.get("life/0")[_SEALED:].decode()
    spare = _until(lambda: [k for k in raw.list_keys() if k.startswith("spare/")], job)[0]
    step = max(s for _, s in _steps(raw))
    forged = {"done": b"3", "stop": b"15", f"dead/{life0}": b"1", spare: b"0:live",
              f"q/{epoch + 1}/members": b"0;0:0:x", "epoch": b"1", "joiners": b"0", "life/0": b"x",
              **{f"d/{epoch}/{s}": b"abort" for s in range(step + 1, 12)}}
    genuine_epoch = raw.get("epoch")
    for key, value in forged.items():
        raw.set(key, value)
    replaced = _first_change(job, "epoch", b"1")
    _garbage(job.port)
    # after the kill: a new quorum; vote its next steps ahead and overwrite the new holder. No
    # /proc sampling while waiting for it: on a loaded machine one sample outlasted the job's
    # last steps, and the store was gone before the strike. Group 0 is a straggler from step 9
    # on (40 times its work per step, about 0.4 s here: it changes no number), so the steps after
    # the kill last seconds, long enough for the strike on a machine loaded by the rest of the
    # suite (at 8 times, 1.5 s in all, a strike once came after the job's end).
    _until(lambda: raw.check(["epoch"]) and raw.get("epoch")[_SEALED:] not in (b"", str(epoch).encode()), job,
           sample=False)
    later = int(raw.get("epoch")[_SEALED:])
    after = {"life/1": b"y"} | {f"d/{later}/{s}": b"abort" for s in range(8, 21)}
    for key, value in after.items():
        raw.set(key, value)
    out = job.finish()
    assert job.proc.returncode == 0, out[-4000:]
    cfg = tiny_config(token_dir, run, "run.steps=20")
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m][-1] == 20, out[-3000:]
    assert "spare pid" in out and "takes its place" in out, out[-3000:]
    assert max_rel_diff(trained_params(cfg), reference_params(cfg, shares=2)) <= 1e-5
    # ``epoch`` is read (and named) when a process puts the genuine bytes back; a quorum closing
    # between the forge and any read writes a new genuine value over it, unread and harmless
    assert replaced, "the forged epoch was never replaced"
    # the death notice of the live group 0 is read only where a process looks for a dead member
    # (a quorum waiting on a member that is slow to connect, a restart claiming a slot): on a fast
    # run nobody reads it. Its effect is what must hold: group 0 was never replaced.
    told = [k for k in forged if not k.startswith("d/") and (k != "epoch" or replaced[0] == genuine_epoch)
            and not k.startswith("dead/")]
    _assert_told(out, told + ["life/1"], processes=5)
    assert out.count(f"intrusion: ignored key 'dead/{life0}'") <= 5, out[-3000:]
    assert "replica group 0: spare pid" not in out and out.count("takes its place") == 2, out[-3000:]
    assert f"intrusion: ignored key 'd/{epoch}/" in out, out[-3000:]  # a vote ahead, read as absent
    _assert_loopback(job, at_least=4)  # the store, the groups' own stores and gloo
    _assert_private(run, ["replicas", "replicas/group-1", "replicas/spare-0"], ["replicas/notices.jsonl"])


def test_ps_job_in_replica_mode_under_forged_lives_and_pid(token_dir, tmp_path, cli_env):
    """A worker and a server, each a world of its own (fault.mode=replica, which needs ps
    async; one worker and one thread, so async is sequential training, deterministic). The
    stranger overwrites the worker's and the server's incarnations with later ones (``life/0``,
    read by the server at every poll for a new incarnation; ``slife/0``, read by the server's
    keeper) and the worker's pid record (``pid/0/1``, read by the worker's keeper), and sends
    malformed frames. Each forged key is named, every push is applied once, every step is
    trained, and the parameters are bit for bit those of the same training never attacked
    (single-process torch). ``done/K`` is not forged: only a restarted server reads it, and no
    process restarts here."""
    run, steps = tmp_path / "run", 24
    job = Job(["2", *_sets(token_dir, run, "parallel.sync=ps", "ps.mode=async", f"run.steps={steps}",
                            "log.interval=8", "data.eval_batches=0", "fault.mode=replica",
                            "parallel.timeout_s=60")],
              cli_env, "link store")
    raw = job.store()
    _until(lambda: raw.check(["life/0", "slife/0", "pid/0/1"]), job)
    # incarnations ahead: read as genuine, the server would link to a worker that never comes
    forged = {"life/0": b"2", "slife/0": b"2", "pid/0/1": b"4242"}
    for key, value in forged.items():
        raw.set(key, value)
    _garbage(job.port)
    while job.proc.poll() is None:
        job.sample()
        time.sleep(0.05)
    out = job.finish()
    assert job.proc.returncode == 0, out[-4000:]
    (stats,) = [json.loads(p.read_text()) for p in sorted((run / "ps").glob("server*.json"))]
    assert stats["updates"] == stats["pushes"] == steps, stats
    _assert_told(out, list(forged), processes=3)
    cfg = tiny_config(token_dir, run, f"run.steps={steps}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the job's run.threads: the same summation order, so the same bits
    try:
        ref = reference_params(cfg)
    finally:
        torch.set_num_threads(threads)
    got = trained_params(cfg)
    assert all(torch.equal(got[k], ref[k]) for k in ref), max_rel_diff(got, ref)
    torch.manual_seed(cfg.run.seed)
    assert max_rel_diff(got, build_reference_model(cfg, 257).state_dict()) > 1e-3  # it trained
    _assert_loopback(job, at_least=3)
    _assert_private(run, ["ps-servers", "ps-worker"], [])


def test_a_failed_world_names_the_logs_that_exist(tmp_path):
    """Every slot failed: the line names the failed slots' own logs directories (a group's under
    replicas/group-N, a spare's under replicas/spare-K), never a RUN/logs that was not written."""
    run = tmp_path / "run"
    (run / "replicas" / "group-1" / "logs").mkdir(parents=True)
    (run / "replicas" / "spare-0" / "logs").mkdir(parents=True)
    with pytest.raises(LaunchError) as e:
        check_groups([1, 2], 2, run, groups=2)
    assert str(run / "replicas" / "group-1" / "logs") in str(e.value)
    assert str(run / "replicas" / "spare-0" / "logs") in str(e.value)
    assert str(run / "logs") + "," not in str(e.value) and not str(e.value).endswith(str(run / "logs"))
    (run / "ps-servers" / "logs").mkdir(parents=True)
    assert see_logs([run / "ps-servers", run / "replicas" / "group-1" / "ps-worker"], run) == \
        str(run / "ps-servers" / "logs")
    assert see_logs([run / "nowhere"], run) == str(run)
