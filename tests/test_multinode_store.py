"""Losing node 0 for good (if a node does not come back, training continues on the remaining
nodes), which the c10d backend cannot survive while node 0's agent hosts the
rendezvous store: here the store is an ``allhands rendezvous-store`` process on a third lab host
and both training hosts dial it (``--rdzv-store external``). Every process of the training host
with node rank 0 (worker rank 0, which also led the first round's worker store) is SIGKILLed after
the step-4 checkpoint; the other host continues alone at world size 1 from that checkpoint, on
the same global batches (within float tolerance of the single-process reference), serving the
next round's worker store itself. Or node 0's command is started again (Slurm --requeue of that
node's task, a Kubernetes pod restart) while the store keeps the job's rendezvous: it rejoins
(``--nnodes 2``: the other node waits for it), leads the next round again, and the job ends
bit-identical to an undisturbed run (killing every process of one host is recovered like any
other fault)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from datetime import datetime, timedelta, timezone

import pytest
import torch
import torch.distributed as dist

from allhands.checkpoint import committed
from allhands.config import load_config
from allhands.launch.launcher import LaunchSpec, _default_run_id
from allhands.netlab import Lab, unavailable
from allhands.launch.rendezvous import CheckedBackend, plan

from isolation import exclusive
from conftest import ALLHANDS, ROOT, TINY
from test_node_loss import JOB, assert_survivor_finished
from test_parity import assert_matches_reference, trained_params
from test_security_network import _listeners

REASON = unavailable()
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}")
TAG, PREFIX = "ahe", "10.64.0"
STORE = f"{PREFIX}.1:29400"


@pytest.fixture(scope="module")
def lab():
    # The store's host, then two training hosts.
    with exclusive("netlab"), Lab(3, tag=TAG, prefix=PREFIX) as lab:
        yield lab


def _read(log) -> str:
    log.seek(0)
    return log.read()


def test_the_store_process_listens_on_its_address_only_and_refuses_bad_input(cli_env):
    # Port 0: it listens on a free one and says which.
    store = subprocess.Popen([*ALLHANDS, "rendezvous-store", "--bind", "127.0.0.1", "--port", "0"],
                             env=cli_env, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = ""
        while "listening on" not in line:
            line = store.stderr.readline()
            assert line or store.poll() is None, "the store process ended before listening"
        said = re.match(r"allhands: listening on 127\.0\.0\.1:(\d+) \(rendezvous store\)", line)
        assert said and int(said[1]) != 0, line
        port = int(said[1])
        assert _listeners({store.pid}) == [("127.0.0.1", port, store.pid)]
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        client.set("k", b"v")
        assert client.get("k") == b"v"
        # A second store on the same port: exit 1, one line naming the port and the fix.
        r = subprocess.run([*ALLHANDS, "rendezvous-store", "--bind", "127.0.0.1", "--port", str(port)],
                           env=cli_env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
            f"allhands: error: port {port} on 127.0.0.1 is in use"), r.stderr
        store.send_signal(signal.SIGTERM)
        assert store.wait(timeout=30) == 0
        assert store.stderr.read().strip().splitlines()[-1] == "allhands: rendezvous store stopped"
    finally:
        if store.poll() is None:
            store.kill()
            store.wait(timeout=60)
    bad = {("rendezvous-store", "--bind", "store.example"): "allhands: error: --bind: ",
           ("train", "--nnodes", "1", "--rdzv-store", "external"):
               "allhands: error: --rdzv-store: external needs --rdzv-endpoint"}
    for args, want in bad.items():
        r = subprocess.run([*ALLHANDS, *args], env=cli_env, capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        assert r.returncode == 2 and r.stderr.strip().startswith(want), r.stderr
    # One external store may serve several jobs: their rendezvous run ids differ by run directory.
    ext = LaunchSpec(nnodes=2, rdzv_endpoint="10.0.0.9:29400", rdzv_store="external")
    assert _default_run_id(ext, "/shared/a") != _default_run_id(ext, "/shared/b")
    # A training node with an external store hosts no rendezvous store, node rank 0 included.
    node0 = plan(run_id="t-external", multi_node=True, node_rank=0, rdzv_endpoint=f"127.0.0.1:{port}",
                 local_addr="127.0.0.1", bind="", port=0, external_store=True)
    try:
        assert node0.rdzv_socket is None and node0.rdzv_configs["is_host"] is False
        assert node0.store_socket.getsockname()[0] == "127.0.0.1"
        assert "(external store: allhands rendezvous-store)" in node0.describe()
    finally:
        node0.close()


class _Payload:
    """Unpickled, it would create the file named (what a crafted state could do to a launcher)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_crafted_rendezvous_state_is_refused_before_torch_unpickles_it(tmp_path):
    """torch's handler unpickles the rendezvous state from the store in every launcher; whoever
    reaches the store can write it. A genuine state passes the check, a crafted one is refused
    in one line and its payload never runs."""
    import base64
    import pickle

    from torch.distributed.elastic.rendezvous.api import RendezvousStateError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousSettings, RendezvousTimeout, _BackendRendezvousStateHolder, _NodeDesc,
        _RendezvousState)

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    backend = CheckedBackend(C10dRendezvousBackend(store, "t-state"), "127.0.0.1:1")
    genuine = _RendezvousState()
    genuine.participants[_NodeDesc("10.0.0.1", 7, 0)] = 0
    genuine.last_heartbeats[_NodeDesc("10.0.0.1", 7, 0)] = datetime.now(timezone.utc)
    genuine.deadline = datetime.now(timezone.utc)
    state, token, ok = backend.set_state(pickle.dumps(genuine))
    assert ok and pickle.loads(backend.get_state()[0]).participants == genuine.participants
    marker = tmp_path / "payload-ran"
    store.set("torch.rendezvous.t-state", base64.b64encode(pickle.dumps(_Payload(marker))))
    with pytest.raises(RendezvousStateError, match=r"^refused the rendezvous state in the store at "
                       r"127.0.0.1:1: it is not torch's \(UnpicklingError: it names io.open\)"):
        backend.get_state()
    # Through torch's own state holder, as a launcher syncs it.
    settings = RendezvousSettings("t-state", 1, 1, RendezvousTimeout(), timedelta(seconds=5), 3)
    holder = _BackendRendezvousStateHolder(backend, settings)
    with pytest.raises(RendezvousStateError):
        holder.sync()
    assert not marker.exists()


def _start_node(lab, rank: int, nnodes: str, sets: list[str], env: dict, log):
    """``allhands train`` of training host ``rank`` (lab host rank + 1), dialling the store."""
    host = lab.hosts[rank + 1]
    cmd = [*ALLHANDS, "train", "--nnodes", nnodes, "--node-rank", str(rank), "--nproc", "1",
           "--rdzv-store", "external", "--rdzv-endpoint", STORE, "--local-addr", host.addr,
           *(x for s in sets for x in ("--set", s))]
    return host.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _kill_node_0(lab, token_dir, tmp_path, cli_env, *, nnodes: str, requeue: bool, late: bool = False):
    """Both training hosts and the store's; node rank 0's whole session SIGKILLed once step 4 is
    committed and, with ``requeue``, its command started again: at once, or with ``late`` only
    after node 1 has gone on alone and committed step 6 (it then stalls before step 7 until node 0
    is back). Returns the run directory and the output of node 1 and of node 0 (its second run
    when requeued, else its first). A recovery that hangs fails on node 1's wait."""
    run_dir = tmp_path / "run"
    # Worker rank 0 (host 1: torch ranks nodes by address) stalls before step 5, so the kill lands
    # after the step-4 checkpoint; its marker keeps the survivor, rank 0 after the loss, going
    # (and a requeued node 0 from stalling again).
    # A last call of 5 s: both nodes dial the store before it starts and join within it.
    # With ``late``, worker rank 0 of the next round, node 1 alone, stalls before step 7 the same
    # way: node 0 comes back while it has not finished.
    hangs = "0:5:hang,0:7:hang" if late else "0:5:hang"
    sets = [*TINY, *JOB, f"data.path={token_dir}", f"run.dir={run_dir}", f"fault.inject={hangs}",
            "fault.rdzv_last_call_s=5"]
    env = dict(cli_env, ALLHANDS_SECRET="lab-test-secret-" + "x" * 16, OMP_NUM_THREADS="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    logs = {n: open(tmp_path / f"{n}.log", "w+") for n in ("store", "node0", "node1")}
    nodes = [_start_node(lab, rank, nnodes, sets, env, logs[f"node{rank}"]) for rank in (0, 1)]
    time.sleep(2)
    store = lab.hosts[0].popen([*ALLHANDS, "rendezvous-store", "--bind", f"{PREFIX}.1"], env=env,
                               stdout=logs["store"], stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not any(step >= 4 for step, _ in committed(run_dir / "checkpoints")):
        assert all(p.poll() is None for p in (*nodes, store)), \
            "a process ended before the kill: " + _read(logs["node1"])[-2000:]
        assert time.monotonic() < deadline, "no checkpoint of step 4 in 240 s"
        time.sleep(0.2)
    os.killpg(nodes[0].pid, signal.SIGKILL)  # launcher, torch's agent and the worker of node 0
    nodes[0].wait(timeout=60)
    if late:
        while not (any(step >= 6 for step, _ in committed(run_dir / "checkpoints"))
                   and "continuing on 1 node(s), world size 1" in _read(logs["node1"])):
            assert nodes[1].poll() is None, "node 1 ended alone: " + _read(logs["node1"])[-3000:]
            assert time.monotonic() < deadline, "node 1 committed no step 6 alone in 240 s"
            time.sleep(0.2)
    if requeue:
        time.sleep(1)
        logs["node0"] = open(tmp_path / "node0-requeued.log", "w+")
        nodes[0] = _start_node(lab, 0, nnodes, sets, env, logs["node0"])
    rc = nodes[1].wait(timeout=240)
    out = _read(logs["node1"])
    assert rc == 0, out[-3000:]
    if requeue:
        rc0 = nodes[0].wait(timeout=60)
        assert rc0 == 0 and "rejoins it (a requeued node or job)" in _read(logs["node0"]), \
            _read(logs["node0"])[-3000:]
    assert f"rendezvous at {STORE} (external store: allhands rendezvous-store)" in out
    (line,) = [x for x in out.splitlines() if "restart 1/2" in x]
    assert ("worker rank 1" in line and f"on node {PREFIX}.3 failed: lost node {PREFIX}.2 "
            "(worker rank 0)" in line and "from checkpoint step 4" in line), line
    # The store outlived the job; it listened on its one address and stops cleanly when told.
    assert store.poll() is None
    store.send_signal(signal.SIGTERM)
    assert store.wait(timeout=30) == 0
    said = _read(logs["store"])
    assert f"allhands: listening on {STORE} (rendezvous store)" in said, said
    assert said.strip().splitlines()[-1] == "allhands: rendezvous store stopped", said
    return run_dir, out, _read(logs["node0"])


@needs_lab
@pytest.mark.exclusive("netlab")
def test_losing_node_rank_0_for_good_with_an_external_store(lab, token_dir, tmp_path, cli_env):
    run_dir, out, _ = _kill_node_0(lab, token_dir, tmp_path, cli_env, nnodes="1:2", requeue=False)
    # The restarted worker built its process group through a worker store (MASTER_ADDR): not on
    # the dead host, nor on the store's host (which serves only the rendezvous store), so the
    # survivor served it.
    assert_survivor_finished(out, run_dir, f"node {PREFIX}.2 (worker rank 0)",
                             "2 hosts, then the one that was not node 0")


@needs_lab
@pytest.mark.exclusive("netlab")
def test_node_rank_0_started_again_rejoins_bit_exact_with_an_external_store(lab, lab_undisturbed, token_dir,
                                                                            tmp_path, cli_env):
    """Slurm --requeue / a pod restart of node 0's host: its original command, run again, rejoins
    the job the other node kept alive in the external store; both resume from step 4 and the job
    ends bit-identical to an undisturbed run at the same world size."""
    run_dir, out, again = _kill_node_0(lab, token_dir, tmp_path, cli_env, nnodes="2", requeue=True)
    assert f"node {PREFIX}.2 came back (a new launcher)" in out, out[-3000:]
    assert "continuing on 2 node(s), world size 2" in out, out[-3000:]
    # Node 0's worker is rank 0 again (torch ranks nodes by address), which says where it resumed.
    assert "resumed from step 4" in again and "done: steps 8" in again, again[-3000:]
    want = trained_params(lab_undisturbed)
    got = trained_params(load_config(run_dir / "config.resolved.toml"))
    assert all(torch.equal(got[k], want[k]) for k in want), "not bit-identical to the undisturbed run"


@needs_lab
@pytest.mark.exclusive("netlab")
def test_node_rank_0_back_after_the_other_went_on_alone_is_admitted(lab, token_dir, tmp_path, cli_env):
    """``--nnodes 1:2``: node 0's host is lost, node 1 goes on alone from step 4 and commits step
    6; then node 0's command is run again. Node 1's agent restarts its workers to admit it (not a
    restart), both resume from step 6, and the job (world size 2, 1, then 2 again, on the same
    global batches) ends within float tolerance of the single-process reference."""
    run_dir, out, again = _kill_node_0(lab, token_dir, tmp_path, cli_env, nnodes="1:2", requeue=True,
                                       late=True)
    assert (f"node {PREFIX}.2 (worker rank 0) left the job" in out
            and "continuing on 1 node(s), world size 1" in out), out[-3000:]
    assert ("a node is waiting to join; node" in out
            and (f"node {PREFIX}.2 joined" in out or f"node {PREFIX}.2 came back" in out)
            and "continuing on 2 node(s), world size 2" in out), out[-3000:]
    assert "resumed from step 6" in again and "done: steps 8" in again, again[-3000:]
    assert_matches_reference(load_config(run_dir / "config.resolved.toml"),
                             "2 hosts, then node 1 alone, then both again")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    world = {r["step"]: len(r["step_time_rank"]) for r in recs if "loss" in r}
    assert (world[4], world[6], world[8]) == (2, 1, 2), world
