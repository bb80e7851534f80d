"""A host on the cluster network without the job secret: two lab hosts run a job, a third one
(which reaches its stores, as any host on that network would) forges records in them while it
runs. Each forgery is refused and named, the job stops in one line, and nobody dials the stranger.

The hosts are network namespaces of the network lab (allhands.netlab: root only); the job is
tests/scripts/store_job.py, one worker per host, and the attacker tests/scripts/store_forger.py
(see test_security_local.py, where another local user does the same).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from allhands.netlab import Lab, unavailable

from conftest import ALLHANDS, ROOT
from test_security_local import FORGER, INTRUSION, strike, undisturbed_or_stopped

REASON = unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}"),
              pytest.mark.exclusive("netlab")]
PIPES = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("what", ["admit", "state"])
def test_a_third_host_without_the_secret_cannot_forge_store_records(what, tmp_path, cli_env):
    """``admit``: the third host's own listener as worker rank 1's connection record of the next
    process group (a forged gloo connection record that would admit it as a member), in node 0's
    worker store; ``state``: torch's rendezvous state with a fake node waiting to join, in the
    rendezvous store. (A forged record read stops the job, so each needs a job of its own.)"""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(cli_env, ALLHANDS_SECRET="lab-test-secret-" + "x" * 16, OMP_NUM_THREADS="1")
    env.pop("GLOO_SOCKET_IFNAME", None)  # each node finds its interface from --local-addr
    stranger_env = {k: v for k, v in env.items() if not k.startswith("ALLHANDS_")}
    with Lab(3, tag="ah6", prefix="10.56.0") as lab:
        node0, node1, third = lab.hosts
        job = [host.popen([*ALLHANDS, "launch", "--nnodes", "2", "--nproc", "1", "--node-rank",
                           str(i), "--rdzv-endpoint", f"{node0.addr}:29400", "--local-addr",
                           host.addr, "tests/scripts/store_job.py", str(out)],
                          env=env, cwd=ROOT, **PIPES)
               for i, host in enumerate((node0, node1))]
        attacker, said = strike(job, out, lambda port: third.popen(
            [sys.executable, FORGER, node0.addr, str(port), what], env=stranger_env, cwd=ROOT,
            **PIPES), what, addr=re.escape(node0.addr))
        try:
            errs = [p.communicate(timeout=120)[1] for p in job]
        finally:
            (out / "go").touch()
        after = attacker.communicate(timeout=30)[0]
    assert said.startswith("forged"), said
    where = re.escape(node0.addr)
    if what == "admit":
        assert re.search(INTRUSION.format(key=r"0//\d+//cpu//0/1", store="worker store",
                                          addr=where), errs[0]), errs[0][-3000:]
        assert after.strip() == "never dialled", after
    else:
        assert any(re.search(INTRUSION.format(key=r"torch\.rendezvous\.[\w-]+",
                                              store="rendezvous store", addr=where), e)
                   for e in errs), [e[-3000:] for e in errs]
    undisturbed_or_stopped(job, errs, out)
