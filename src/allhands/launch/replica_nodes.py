"""Replica mode across nodes: every node runs its own replica groups (one single-node launcher
each, as launch/replicas.py does on one node), and all of them meet in one quorum store that
node 0 hosts where a multi-node job's rendezvous would be: the ``--rdzv-endpoint`` address and
port (``--bind`` wins), bound to that one address (listeners.py), its values MAC'd under a secret
derived from the job secret every node already holds.

Group ``G`` of the job is local group ``g`` of node ``r``: ``G = r * nproc + g``. Each group's own
world (its agent, rendezvous and worker store) stays on loopback; only the quorum's gloo group
crosses nodes, listening on this node's address (``--local-addr``, else ``--bind``, else the
address on the route to node 0), and its members prove the replica secret over it before any
tensor crosses (replica/quorum.py). Node 0 keeps the store up until every node said its groups
ended (or ``parallel.timeout_s`` after its own did), so a slower node can still finish.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from allhands import admission
from allhands.authstore import sealed
from allhands.config import Config
from allhands.errors import ConfigError
from allhands.launch import forkstart
from allhands.launch.listeners import is_wildcard, resolve
from allhands.launch.replicas import check_groups, end_slots, group_main
from allhands.launch.storehost import HostedStore

_LABEL = b"allhands-replica-quorum-v1"


def replica_secret(job_secret: str | None) -> str | None:
    """The quorum's secret, the same on every node: an HMAC of the job secret (kept apart from
    its other uses); None with --insecure."""
    return hmac.new(job_secret.encode(), _LABEL, hashlib.sha256).hexdigest() if job_secret else None


def run_secret(store: dist.Store, secret: str, node_rank: int, nnodes: int, wait_s: float) -> str:
    """The quorum's secret for this run of the job: the replica secret bound to a fresh nonce of
    every node. The job secret is the same for every run of a job, so without it a genuine value
    recorded from an earlier run (``done``) could be replayed into this one; with it, a value of
    another run has no valid MAC. (A nonce replayed before its node wrote its own only makes the
    nodes disagree: every value then fails its MAC, a denial of service, never a forgery.)"""
    store.set(f"run/{node_rank}", secrets.token_hex(16))
    store.wait([f"run/{r}" for r in range(nnodes)], timedelta(seconds=wait_s))  # every node started
    nonces = b"".join(store.get(f"run/{r}") for r in range(nnodes))
    return hmac.new(secret.encode(), b"run:" + nonces, hashlib.sha256).hexdigest()


def quorum_endpoint(spec: Any) -> tuple[str, int]:
    """Where node 0 hosts the quorum store: ``--rdzv-endpoint``'s address and port."""
    host, _, port = spec.rdzv_endpoint.rpartition(":")
    if int(port) == 0:  # the other nodes would have to be told the port node 0's store got
        raise ConfigError(f"--rdzv-endpoint: {spec.rdzv_endpoint!r}: a multi-node replica-mode job "
                          f"needs the port the quorum store listens on, in [1, 65535], on every node")
    return resolve(host.strip("[]")), int(port)


def local_address(spec: Any, quorum_host: str) -> str:
    """This node's address for the quorum's gloo connections (what other nodes dial)."""
    if spec.local_addr:
        return resolve(spec.local_addr, "--local-addr")
    if spec.bind and not is_wildcard(spec.bind):
        return spec.bind
    family = socket.AF_INET6 if ":" in quorum_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((quorum_host, 9))  # a UDP connect sends nothing; it only picks the route
        return s.getsockname()[0]


def run_replica_nodes(cfg: Config, nproc: int, job: Any, *, launch: Callable, entry: Callable,
                      group_spec: Any, policy: Any) -> None:
    """This node's ``nproc`` replica groups of a multi-node replica-mode job, until they end;
    LaunchError when every one of them failed for good."""
    if cfg.fault.spares:
        raise ConfigError(f"fault.spares: {cfg.fault.spares} spares run on one node for now; set "
                          f"fault.spares=0 for a multi-node replica-mode job")
    spec = group_spec  # the job's launch spec with nproc=1: node rank, endpoint, addresses
    host, port = quorum_endpoint(spec)
    secret = replica_secret(admission.job_secret(multi_node=True, secret_file=spec.secret_file,
                                                 insecure=spec.insecure, env=os.environ))
    address = local_address(spec, host)
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    master = None
    if spec.node_rank == 0:  # on that one address (a store process: storehost.py)
        master = HostedStore(spec.bind or host, port, "replica quorum store", cfg.parallel.timeout_s)
        master.ready()
    where = f"replica quorum store at {host}:{port}"
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if secret:  # every value of this run is MAC'd under a secret of this run only
        base = sealed(client, secret, where, tolerant=True)
        secret = run_secret(base, secret, spec.node_rank, spec.nnodes, cfg.fault.rdzv_join_timeout_s)
        base.close()
    store = sealed(client, secret, where, tolerant=True)
    one_node = dataclasses.replace(spec, nnodes=1, node_rank=0, rdzv_endpoint="", local_addr="",
                                   bind="", min_nodes=0, rdzv_store="node0", secret_file="")
    groups = nproc * spec.nnodes
    mine = [spec.node_rank * nproc + g for g in range(nproc)]
    procs = [forkstart.process(group_main, (cfg.to_dict(), job, g, groups, f"{g},{groups},{host},{port},{address}",
                                            secret or "", launch, entry, one_node, policy), f"allhands-replica-{g}")
             for g in mine]
    for p in procs:
        p.start()
    print(f"allhands: replica mode: node {spec.node_rank} runs replica groups "
          f"{', '.join(map(str, mine))} of {groups}; quorum store at {host}:{port}; gloo on {address}",
          file=sys.stderr, flush=True)
    try:
        for p in procs:
            p.join()
        store.set(f"node/{spec.node_rank}/ended", "1")
        if master is not None:  # the others' groups may still be finishing against this store
            _wait_for_nodes(store, spec.nnodes, cfg.parallel.timeout_s)
    finally:
        end_slots(procs)
        if hasattr(store, "close"):  # a MACStore's keeper (not with --insecure)
            store.close()
        if master is not None:
            master.close()
    failed = [g for g, p in zip(mine, procs) if p.exitcode != 0]
    check_groups(failed, len(procs), Path(cfg.run.dir), groups, f" of node {spec.node_rank}")


def _wait_for_nodes(store: dist.Store, nnodes: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check([f"node/{r}/ended" for r in range(nnodes)]):
            return
        time.sleep(0.2)

