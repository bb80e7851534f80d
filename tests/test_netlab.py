"""The network lab (namespaces joined by a bridge, capped links) and a real multi-node job on
it: two lab hosts, each running the documented ``allhands train --nnodes 2 ...`` command, end
with the parameters of the single-process reference."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from allhands.netlab import Lab, leftovers, unavailable

from conftest import ALLHANDS, TINY
from test_parity import max_rel_diff, reference_params, trained_params

REASON = unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}"),
              pytest.mark.exclusive("netlab")]
TAG, PREFIX = "ah5", "10.55.0"

# A plain TCP receiver: counts bytes from the first to the last one and prints "bytes seconds".
SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    t0 = t0 or time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""


def stream(src, dst, nbytes: int, port: int = 5201) -> float:
    """Send ``nbytes`` over one TCP connection from host ``src`` to ``dst``; Mbit/s received."""
    sink = dst.popen([sys.executable, "-c", SINK, dst.addr, str(port)], stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    send = (f"import socket; s = socket.create_connection(({dst.addr!r}, {port}), timeout=30); "
            f"s.sendall(bytes({nbytes})); s.close()")
    r = src.run([sys.executable, "-c", send], timeout=60)
    assert r.returncode == 0, r.stderr
    n, seconds = sink.stdout.readline().split()
    sink.wait(timeout=30)
    assert int(n) == nbytes
    return int(n) * 8 / float(seconds) / 1e6


@pytest.mark.serial  # measures bandwidth against the cap
def test_lab_reach_cap_and_cleanup():
    with Lab(3, rate_mbit=100, tag=TAG, prefix=PREFIX) as lab:
        made = lab.names()
        assert leftovers(lab.id) == sorted(made)
        for src in lab.hosts:  # every host reaches every other one over its own address
            for dst in lab.hosts:
                if src is not dst:
                    assert stream(src, dst, 10_000, port=6000) > 0
        a, b = lab.hosts[:2]
        before = a.counters()
        # 6 MB at 100 Mbit/s is ~0.5 s: long against tbf's 64 kB burst, short for the suite.
        up = stream(a, b, 6_000_000)
        down = stream(b, a, 6_000_000)
        sent = a.counters()["tx_bytes"] - before["tx_bytes"]
        assert 0.8 * 100 <= up <= 1.2 * 100, f"a -> b {up:.1f} Mbit/s under a 100 Mbit/s cap"
        assert 0.8 * 100 <= down <= 1.2 * 100, f"b -> a {down:.1f} Mbit/s under a 100 Mbit/s cap"
        assert 6_000_000 <= sent <= 6_000_000 * 1.1  # payload plus TCP/IP headers
        a.popen(["sleep", "600"])  # a process still running at close is killed with its host
    assert leftovers(lab.id) == []


def test_lab_cleans_up_after_a_failure():
    with pytest.raises(RuntimeError, match="boom"):
        with Lab(2, tag=TAG, prefix=PREFIX) as lab:
            lab.hosts[0].popen(["sleep", "600"])
            raise RuntimeError("boom")
    assert leftovers(lab.id) == []
    lab2 = Lab(1, tag=TAG, prefix=PREFIX)  # dropped without close: the finalizer cleans up
    ident = lab2.id
    del lab2
    assert leftovers(ident) == []


def test_two_lab_hosts_train_like_one_process(token_dir, tmp_path, cli_env):
    """2 hosts x 2 workers with the documented multi-node command == the single-process
    reference (fp32, relative difference <= 1e-5); bytes on eth0 match the meters' count."""
    run_dir = tmp_path / "run"
    sets = [*TINY, f"data.path={token_dir}", f"run.dir={run_dir}", "run.check_sync=true"]
    env = dict(cli_env, ALLHANDS_SECRET="lab-test-secret-" + "x" * 16, OMP_NUM_THREADS="1")
    # An in-process single-node job earlier in this pytest process set GLOO_SOCKET_IFNAME=lo;
    # here the launcher must pick the lab interface from --local-addr.
    env.pop("GLOO_SOCKET_IFNAME", None)
    with Lab(2, tag=TAG, prefix=PREFIX) as lab:
        endpoint = f"{lab.hosts[0].addr}:29400"
        procs = []
        for rank, host in enumerate(lab.hosts):
            cmd = [*ALLHANDS, "train", "--nnodes", "2", "--node-rank", str(rank), "--nproc", "2",
                   "--rdzv-endpoint", endpoint, "--local-addr", host.addr,
                   *(x for s in sets for x in ("--set", s))]
            procs.append(host.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True))
            time.sleep(0.5)  # node 0 first: it hosts the rendezvous
        outs = [p.communicate(timeout=240)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
    from allhands.config import load_config

    done = load_config(run_dir / "config.resolved.toml")
    diff = max_rel_diff(trained_params(done), reference_params(done))
    assert diff <= 1e-5, f"2 lab hosts x 2 workers: relative difference {diff:.2e}"
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    # Every rank sent something over eth0 (loopback traffic within a host is not on eth0).
    assert all(r["net_tx_bytes"] > 0 for r in steps)
    assert all(r["comm_bytes"] > 0 for r in steps)
    assert len(steps[0]["step_time_rank"]) == 4
