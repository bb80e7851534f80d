"""Listeners and admission of real jobs: what listens where, and who is let in.

Each job here is `allhands launch` of tests/scripts/admission_job.py (build the mesh, so admission
runs, then all_reduce rank + 1), started the way a user starts one.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from allhands.admission import job_secret, worker_environment
from allhands.errors import ConfigError, LaunchError
from allhands.launch.rendezvous import plan

from conftest import ALLHANDS, ROOT

JOB = "tests/scripts/admission_job.py"


def _launch(args, env, **kw) -> subprocess.Popen:
    return subprocess.Popen([*ALLHANDS, "launch", *args], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _finish(procs, timeout=240) -> list[str]:
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            p.kill()
    return [p.communicate(timeout=60)[1] for p in procs]


# --------------------------------------------------------------------------- /proc/net


def _addr(hex_addr: str) -> str:
    """/proc/net/tcp{,6} address: the IP as host-order 32-bit words in hex."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def _listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state that one of ``pids`` holds,
    read from each process's own network namespace (/proc/PID/net/tcp{,6})."""
    found = set()
    for pid in pids:
        try:
            inodes = {os.readlink(fd)[8:-1] for fd in Path(f"/proc/{pid}/fd").iterdir()
                      if os.readlink(fd).startswith("socket:[")}
            tables = [Path(f"/proc/{pid}/net/{t}").read_text() for t in ("tcp", "tcp6")]
        except OSError:
            continue  # exited meanwhile
        for line in "\n".join(tables).splitlines():
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A: TCP_LISTEN
                host, port = f[1].split(":")
                found.add((_addr(host), int(port, 16), pid))
    return sorted(found)


def announced_port(log: Path, proc: subprocess.Popen, timeout: float = 120) -> int:
    """The rendezvous store's port in the line a node given ``--rdzv-endpoint HOST:0`` writes
    to ``log`` (its stderr): the port the other nodes dial."""
    deadline = time.monotonic() + timeout
    while not (said := re.search(r"^allhands: listening on \S+:(\d+) \(rendezvous store\)",
                                 log.read_text(), re.M)):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    return int(said[1])


def _wait_for(paths, procs, timeout=180) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for proc in procs:
            assert proc.poll() is None, proc.communicate(timeout=60)[1][-3000:]
        assert time.monotonic() < deadline, "the job did not reach its all_reduce in time"
        time.sleep(0.2)


def test_single_host_job_listens_on_loopback_only(tmp_path, cli_env):
    out = tmp_path / "out"
    out.mkdir()
    proc = _launch(["--nproc", "2", JOB, str(out), "120"], cli_env)
    try:
        _wait_for([out / "rank0.json", out / "rank1.json"], [proc])
        listening = _listeners(_descendants(proc.pid))
    finally:
        (out / "go").touch()
    err = _finish([proc])[0]
    assert proc.returncode == 0, err[-3000:]
    # The launcher's two stores and one gloo listener per worker, at least.
    pids = {pid for _, _, pid in listening}
    assert len(listening) >= 4 and len(pids) >= 3, listening
    bad = [entry for entry in listening if not ipaddress.ip_address(entry[0]).is_loopback]
    assert not bad, f"listening beyond loopback: {bad}"
    line = next(ln for ln in err.splitlines() if ln.startswith("allhands: listening on"))
    announced = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", line)}
    assert len(announced) == 2 and announced <= {port for _, port, _ in listening}, line
    assert "gloo on lo" in line and "prove the job secret" in line
    assert [json.loads((out / f"rank{r}.json").read_text())["sum"] for r in (0, 1)] == [3.0, 3.0]


# --------------------------------------------------------------------------- strangers


def test_rank_with_another_secret_is_refused_before_any_tensor(tmp_path, cli_env):
    """The last rank runs allhands with a secret that is not the job's: its connection record in
    the worker store carries a MAC under that other secret, so rank 0 refuses it (an intrusion,
    named by its key) before gloo connects, and no all_reduce result exists."""
    proc = _launch(["--nproc", "2", JOB, str(tmp_path), "0", "wrong-secret"], cli_env)
    err = _finish([proc])[0]
    assert proc.returncode == 1, err[-3000:]
    refusal = [ln for ln in err.splitlines() if ln.startswith("allhands: intrusion:")]
    assert any(re.search(r"refused key '0//cpu//0/1' in the worker store at "
                         r"127\.0\.0\.1:\d+: its value has no valid MAC", ln)
               for ln in refusal), err[-3000:]
    summary = [ln for ln in err.splitlines() if ln.startswith("allhands: error:")]
    assert len(summary) == 1 and "IntrusionError" in summary[0] and "Traceback" not in err
    assert not list(tmp_path.glob("*.json"))


def test_raw_stranger_that_all_reduces_poison_gets_no_result_in(tmp_path, cli_env):
    """A stranger: takes rank 1 without allhands, through the job's worker store and keys, and
    all_reduces 1000 at once. Its connection record has no MAC, so rank 0 refuses it before gloo
    connects: the poison never meets a tensor of the job, and the job's line names the refusal
    (an intrusion), not a lost node."""
    proc = _launch(["--nproc", "2", JOB, str(tmp_path), "0", "raw"], cli_env)
    err = _finish([proc])[0]
    assert proc.returncode == 1, err[-3000:]
    summary = [ln for ln in err.splitlines() if ln.startswith("allhands: error:")]
    assert len(summary) == 1 and "IntrusionError" in summary[0], err[-3000:]
    assert "refused key '0//cpu//0/1' in the worker store" in summary[0], summary
    assert "lost node" not in err, err[-3000:]
    assert not (tmp_path / "rank0.json").exists()
    stranger = tmp_path / "stranger.json"
    assert not stranger.exists() or json.loads(stranger.read_text())["sum"] != 1001.0


def test_multi_node_needs_the_same_secret_on_every_node(tmp_path, cli_env):
    nodes = ["--nnodes", "2", "--nproc", "1", "--local-addr", "127.0.0.1"]
    for var in ("ALLHANDS_SECRET", "ALLHANDS_SECRET_FILE"):
        cli_env.pop(var, None)

    # No secret at all: exit 2 before anything listens, one line saying how to give one.
    r = subprocess.run([*ALLHANDS, "launch", *nodes, "--node-rank", "0", "--rdzv-endpoint",
                        "127.0.0.1:0", JOB, str(tmp_path)], env=cli_env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "ALLHANDS_SECRET" in r.stderr and "--secret-file" in r.stderr

    # A secret file every user can read: refused in one line.
    secret_file = tmp_path / "job.secret"
    secret_file.write_text("s" * 40 + "\n")
    secret_file.chmod(0o644)
    r = subprocess.run([*ALLHANDS, "launch", *nodes, "--node-rank", "0", "--rdzv-endpoint",
                        "127.0.0.1:0", "--secret-file", str(secret_file), JOB,
                        str(tmp_path)], env=cli_env, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "chmod 600" in r.stderr and r.stderr.count("\n") == 1, r.stderr

    # Node 0 with the file's secret, node 1 with another one: node 1 refuses the rendezvous
    # state node 0 wrote (its MAC is under the other secret) and stops in one line; node 0 goes
    # on waiting for a node that holds the secret (here: stopped by the test). Nothing computed.
    # Node 0 is given port 0: it listens on a free one and says which (its log); node 1 dials it.
    secret_file.chmod(0o600)
    other = dict(cli_env, ALLHANDS_SECRET="t" * 40)
    log0 = tmp_path / "node0.log"
    with open(log0, "w") as log:
        procs = [subprocess.Popen([*ALLHANDS, "launch", *nodes, "--node-rank", "0", "--rdzv-endpoint",
                                   "127.0.0.1:0", "--secret-file", str(secret_file), JOB, str(tmp_path)],
                                  env=cli_env, cwd=ROOT, text=True, stdout=log, stderr=subprocess.STDOUT)]
    try:
        procs.append(_launch([*nodes, "--node-rank", "1", "--rdzv-endpoint",
                              f"127.0.0.1:{announced_port(log0, procs[0])}", JOB, str(tmp_path)], other))
        procs[1].wait(timeout=120)
    finally:
        procs[0].terminate()
    errs = _finish(procs)
    errs[0] = log0.read_text()
    assert procs[1].returncode == 1, errs[1][-2000:]
    assert re.search(r"allhands: error: intrusion: refused key 'torch\.rendezvous\.[\w-]+' in the "
                     r"rendezvous store at 127\.0\.0\.1:\d+: its value has no valid MAC",
                     errs[1]), errs[1][-3000:]
    assert not list(tmp_path.glob("rank*.json"))
    for secret in ("s" * 40, "t" * 40):
        assert all(secret not in e for e in errs)


# --------------------------------------------------------------------------- units


def test_job_secret_sources(tmp_path, capsys):
    a, b = (job_secret(multi_node=False, secret_file="", insecure=False, env={}) for _ in "ab")
    assert re.fullmatch(r"[0-9a-f]{64}", a) and a != b  # fresh per single-host job

    env = {"ALLHANDS_SECRET": "e" * 20}
    assert job_secret(multi_node=True, secret_file="", insecure=False, env=env) == "e" * 20
    f = tmp_path / "s"
    f.write_text("f" * 20 + "\n")
    f.chmod(0o600)  # only its owner may read it (group- and world-readable are refused)
    env["ALLHANDS_SECRET_FILE"] = str(f)
    assert job_secret(multi_node=True, secret_file="", insecure=False, env=env) == "f" * 20
    g = tmp_path / "g"
    g.write_text("g" * 20)
    g.chmod(0o600)
    assert job_secret(multi_node=True, secret_file=str(g), insecure=False, env=env) == "g" * 20

    with pytest.raises(ConfigError, match="fewer than 16"):
        job_secret(multi_node=True, secret_file="", insecure=False, env={"ALLHANDS_SECRET": "x"})
    with pytest.raises(ConfigError, match="does not exist"):
        job_secret(multi_node=True, secret_file=str(tmp_path / "no"), insecure=False, env={})
    with pytest.raises(ConfigError, match="ALLHANDS_SECRET_FILE"):
        job_secret(multi_node=True, secret_file="", insecure=False, env={})

    assert job_secret(multi_node=True, secret_file="", insecure=True, env={}) is None
    assert "--insecure" in capsys.readouterr().err
    assert worker_environment(None) == {"ALLHANDS_SECRET": None, "ALLHANDS_INSECURE": "1"}


def test_plan_binds_where_asked(capsys):
    single = plan(run_id="t-single", multi_node=False, node_rank=0, rdzv_endpoint="",
                  local_addr="", bind="", port=0)
    try:
        assert single.rdzv_socket.getsockname()[0] == "127.0.0.1"
        assert single.store_socket.getsockname()[0] == "127.0.0.1"
        assert single.local_addr == "127.0.0.1" and single.endpoint.startswith("127.0.0.1:")
        busy = single.rdzv_socket.getsockname()[1]
        single.rdzv_socket.listen()
        with pytest.raises(LaunchError, match=f"port {busy} on 127.0.0.1 is in use"):
            plan(run_id="t-busy", multi_node=False, node_rank=0, rdzv_endpoint="",
                 local_addr="", bind="", port=busy)
    finally:
        single.close()

    # Node 0 given port 0 binds a free one and names it in its endpoint and its line.
    node0 = plan(run_id="t-node0", multi_node=True, node_rank=0,
                 rdzv_endpoint="127.0.0.1:0", local_addr="", bind="", port=0)
    port = node0.rdzv_socket.getsockname()[1]
    node1 = plan(run_id="t-node1", multi_node=True, node_rank=1,
                 rdzv_endpoint=node0.endpoint, local_addr="127.0.0.1", bind="", port=0)
    try:
        assert port != 0 and node0.endpoint == f"127.0.0.1:{port}"
        assert f"listening on 127.0.0.1:{port} (rendezvous store)" in node0.describe()
        assert node1.rdzv_socket is None and f"rendezvous at 127.0.0.1:{port}" in node1.describe()
        assert node1.store_socket.getsockname()[0] == "127.0.0.1"
    finally:
        node0.close()
        node1.close()

    wide = plan(run_id="t-wide", multi_node=False, node_rank=0, rdzv_endpoint="", local_addr="",
                bind="0.0.0.0", port=0)
    try:
        assert wide.rdzv_socket.getsockname()[0] == "0.0.0.0" and wide.local_addr == "127.0.0.1"
        assert "all interfaces" in capsys.readouterr().err
    finally:
        wide.close()


def test_worker_without_secret_refuses_to_start(tmp_path, cli_env):
    """Workers started by hand (as plain torchrun would) have no secret: each stops before any
    collective, in one line, unless ALLHANDS_INSECURE=1 opts out."""
    for var in ("ALLHANDS_SECRET", "ALLHANDS_SECRET_FILE", "ALLHANDS_INSECURE"):
        cli_env.pop(var, None)
    import torch.distributed as dist

    base = dict(cli_env, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS="1", TORCHELASTIC_USE_AGENT_STORE="True")

    def workers(**extra):
        # The store torchrun's agent hosts for its workers (TORCHELASTIC_USE_AGENT_STORE), a
        # fresh one per run, on a port it bound itself: no worker binds a port picked for it.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        procs = [subprocess.Popen([ALLHANDS[0], JOB, str(tmp_path)],
                                  env=dict(base, MASTER_PORT=str(store.port), RANK=str(r),
                                           LOCAL_RANK=str(r), **extra),
                                  cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) for r in (0, 1)]
        return procs, _finish(procs, timeout=120)

    procs, errs = workers()
    assert [p.returncode for p in procs] == [1, 1], errs
    for r, err in enumerate(errs):
        assert f"worker rank {r} has no job secret" in err and "ALLHANDS_SECRET" in err, err
    assert not list(tmp_path.glob("rank*.json"))

    procs, errs = workers(ALLHANDS_INSECURE="1")
    assert [p.returncode for p in procs] == [0, 0], errs
    assert json.loads((tmp_path / "rank1.json").read_text())["sum"] == 3.0


def test_launch_spec_checks_bind_and_secret_before_anything_runs(monkeypatch):
    from allhands.launch.launcher import LaunchSpec

    monkeypatch.delenv("ALLHANDS_SECRET", raising=False)
    monkeypatch.delenv("ALLHANDS_SECRET_FILE", raising=False)
    with pytest.raises(ConfigError, match="--bind: 'eth0' is not an IP address"):
        LaunchSpec(nproc=1, bind="eth0").validated()
    many = dict(nproc=1, nnodes=2, rdzv_endpoint="10.0.0.1:29400")
    with pytest.raises(ConfigError, match="needs a secret shared by every node"):
        LaunchSpec(**many).validated()
    assert LaunchSpec(**many, insecure=True).validated().insecure
    monkeypatch.setenv("ALLHANDS_SECRET", "x" * 32)
    assert LaunchSpec(**many).validated().nnodes == 2


def test_only_node_0_hosting_the_store_may_be_given_rendezvous_port_0():
    """Node 0 binds a free port and says it (test_plan_binds_where_asked); the other nodes, and
    every node of an external store, dial a port they must be told, as every node of a replica-mode
    job dials its quorum store. The rendezvous run id is the same on every node whichever port
    node 0 was given."""
    from allhands.launch.launcher import LaunchSpec, _default_run_id
    from allhands.launch.replica_nodes import quorum_endpoint

    node0 = LaunchSpec(nproc=1, nnodes=2, rdzv_endpoint="10.0.0.1:0", insecure=True)
    assert node0.validated().rdzv_endpoint == "10.0.0.1:0"
    for bad in (dict(node_rank=1), dict(rdzv_store="external")):
        with pytest.raises(ConfigError, match=r"'10\.0\.0\.1:0' is not HOST:PORT with a port in \[1, 65535\]$"):
            dataclasses.replace(node0, **bad).validated()
    with pytest.raises(ConfigError, match=r"in \[1, 65535\], or 0 for a free one$"):
        dataclasses.replace(node0, rdzv_endpoint="10.0.0.1:65536").validated()
    with pytest.raises(ConfigError, match="a multi-node replica-mode job needs the port"):
        quorum_endpoint(node0)
    node1 = dataclasses.replace(node0, node_rank=1, rdzv_endpoint="10.0.0.1:41234")
    assert _default_run_id(node0) == _default_run_id(node1)


# --------------------------------------------------------------------------- two hosts


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, 10.66.0.1 and 10.66.0.2 (root only)."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = f"ahs{os.getpid() % 100000}"
    hosts = [(f"{tag}a", f"{tag}va", "10.66.0.1"), (f"{tag}b", f"{tag}vb", "10.66.0.2")]
    try:
        for ns, _, _ in hosts:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, dev, addr in hosts:
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for ns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        pytest.skip(f"cannot create network namespaces: {e.stderr.decode().strip()}")
    yield [(ns, addr) for ns, _, addr in hosts]
    for ns, _, _ in hosts:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.mark.exclusive("netlab")
def test_two_hosts_listen_on_the_named_addresses_only(tmp_path, cli_env, two_hosts):
    """Node 0 hosts the rendezvous on 10.66.0.1, node 1 joins from 10.66.0.2 with the same
    secret: every listener of either node is on its own named address, and the job computes."""
    cli_env["ALLHANDS_SECRET"] = "0123456789abcdef" * 2
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # set by in-process launches
        cli_env.pop(var, None)  # before; each node must find its interface from --local-addr
    out = tmp_path / "out"
    out.mkdir()
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, *ALLHANDS, "launch", "--nnodes", "2",
                               "--nproc", "1", "--node-rank", str(i), "--rdzv-endpoint",
                               "10.66.0.1:29400", "--local-addr", addr, JOB, str(out), "120"],
                              env=cli_env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
             for i, (ns, addr) in enumerate(two_hosts)]
    try:
        _wait_for([out / "rank0.json", out / "rank1.json"], procs, timeout=120)
        listening = [_listeners(_descendants(p.pid)) for p in procs]
    finally:
        (out / "go").touch()
    errs = _finish(procs)
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    ports0 = {port for addr, port, _ in listening[0]}
    assert 29400 in ports0 and len(listening[0]) >= 3, listening  # rendezvous, store, gloo
    assert listening[1], listening  # node 1's gloo
    for (_, addr), found in zip(two_hosts, listening):
        assert {a for a, _, _ in found} == {addr}, found
    assert [json.loads((out / f"rank{r}.json").read_text())["sum"] for r in (0, 1)] == [3.0, 3.0]
