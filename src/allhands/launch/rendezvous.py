"""Torch's c10d rendezvous with listeners bound to one address, never to all interfaces.

torch 2.13 creates two TCPStores per job and both listen on ``[::]`` whatever host they are
given: the rendezvous store (``c10d_rendezvous_backend.
_create_tcp_store``) and the store the workers share (``DynamicRendezvousHandler.
_create_tcp_store_server``, port 0, reached through MASTER_ADDR/MASTER_PORT with
TORCHELASTIC_USE_AGENT_STORE). A socket bound here and handed to ``TCPStore(master_listen_fd=)``
makes the store listen on that address only. Everything else is torch's own code: the
``DynamicRendezvousHandler`` state machine and the ``C10dRendezvousBackend``; we register the
result with torch's ``rendezvous_handler_registry`` as :data:`BACKEND`.

The sockets are bound in the launcher before ``elastic_launch`` (so a busy port is one clear
error, and there is no window between choosing a free port and binding it) and looked up by run
id when torch asks the registry for the handler. The backend is wrapped (:class:`CheckedBackend`)
because torch unpickles the rendezvous state it reads from a store anyone reachable can write.

Where the rendezvous store lives. torch's c10d backend keeps it in the agent of one node
(``is_host``; ours: ``--node-rank 0``), so that node is the one the job cannot lose; torch's docs
point to etcd for a store that survives its nodes, but both of torch 2.13's etcd backends
(``etcd``, ``etcd-v2``) speak etcd's v2 API through python-etcd, which current etcd releases no
longer serve by default, and neither etcd nor python-etcd is installed here. The c10d way to the
same end is the same TCPStore in a process of its own, on a host that does not train:
:func:`serve_store` (``allhands rendezvous-store``), with every training node a client
(``--rdzv-store external``). The rendezvous
state (rounds, participants, keep-alives) lives in that store and nowhere else, and the worker
store is created per round by whichever node leads it (NarrowRendezvousHandler), so after node 0
is lost for good the survivors re-rendezvous without it and one of them serves the next worker
store.
"""

from __future__ import annotations

import io
import ipaddress
import pickle
import signal
import socket
import sys
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError, RendezvousError, RendezvousInfo, RendezvousStateError,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler, RendezvousBackend, RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from allhands.authstore import sealed
from allhands.errors import LaunchError
from allhands.launch.listeners import (_LOCK, _PLANS, BACKEND, Listeners, Timeouts, _dialable,
                                      _hostport, bind_socket, is_wildcard, resolve)

def plan(*, run_id: str, multi_node: bool, node_rank: int, rdzv_endpoint: str, local_addr: str,
         bind: str, port: int, timeouts: Timeouts = Timeouts(),
         external_store: bool = False) -> Listeners:
    """Bind this node's listeners and register them under ``run_id`` for :func:`create_handler`.

    Single node: everything on 127.0.0.1 (``bind`` may name another address). Multi-node: node 0
    hosts the rendezvous store on the endpoint's address; the worker store goes on ``bind``, else
    ``local_addr``, else the endpoint's address (node 0) or this host name's address. All
    interfaces only when ``bind`` says so (0.0.0.0 or ::), with a warning. ``external_store``:
    no node hosts the rendezvous store, every node dials it at the endpoint (:func:`serve_store`).
    """
    notes = []
    if bind and is_wildcard(bind):
        print(f"allhands: warning: --bind {bind} listens on all interfaces: any host that can "
              f"route here reaches the job's stores; only the job secret keeps strangers out",
              file=sys.stderr, flush=True)
    if not multi_node:
        host = bind or "127.0.0.1"
        rdzv = bind_socket(host, port, "rendezvous store")
        try:
            store = bind_socket(host, 0, "worker store")
        except LaunchError:
            rdzv.close()
            raise
        endpoint = _hostport(_dialable(host), rdzv.getsockname()[1])
        local = _dialable(host)
        configs: dict[str, Any] = {"is_host": True, "join_timeout": 60}
    else:
        ep_host, _, ep_port = rdzv_endpoint.rpartition(":")
        ep_host = ep_host.strip("[]")
        endpoint = rdzv_endpoint
        rdzv = None
        hosts = node_rank == 0 and not external_store
        if hosts:
            rdzv_addr = bind or resolve(ep_host)
            rdzv = bind_socket(rdzv_addr, int(ep_port), "rendezvous store")
            if int(ep_port) == 0:  # torch's rendezvous and every message name the port bound
                endpoint = _hostport(ep_host, rdzv.getsockname()[1])
            if ipaddress.ip_address(rdzv_addr).is_loopback:
                notes.append(f"{ep_host!r} is a loopback address: only this host can join")
        store_addr = bind or local_addr or (resolve(ep_host) if hosts
                                            else resolve(socket.getfqdn(), "--local-addr"))
        try:
            store = bind_socket(store_addr, 0, "worker store")
        except LaunchError:
            if rdzv is not None:
                rdzv.close()
            raise
        local = local_addr or (None if is_wildcard(store_addr) else store_addr)
        configs = {"is_host": hosts, **timeouts.configs()}
    listeners = Listeners(run_id, endpoint, local, rdzv, store, configs, notes,
                          external=multi_node and external_store)
    with _LOCK:
        _PLANS[run_id] = listeners
    register()
    return listeners


class NarrowRendezvousHandler(DynamicRendezvousHandler):
    """torch's handler; the worker store is created on our pre-bound socket, and renewed for
    every round of the rendezvous.

    torch 2.13 creates the worker store (``MASTER_ADDR:MASTER_PORT``) once per handler and
    publishes its address in the round's store only the first time this node leads: a node that
    joins a later round (a requeued host) then waits for ``MASTER_ADDR`` under a round prefix
    nobody writes. And the restarted workers would meet the previous round's keys in the same
    store (process group keys are named by group, not by round): gloo's ``connectFullMesh`` can
    read a dead peer's old address there ("Connection refused", a cause of the restart flake). So here every round gets a fresh store, published
    in that round's prefix by whoever leads it, and every other node reads it back.
    """

    listeners: Listeners
    _members: dict[str, int] = {}

    def _create_tcp_store_server(self, master_addr, master_port):
        # master_port is 0 in torch 2.13: the socket's own port is published instead.
        return dist.TCPStore(host_name=_dialable(master_addr), port=master_port, is_master=True,
                             multi_tenant=True, master_listen_fd=self.listeners.worker_store_fd())

    def next_rendezvous(self) -> RendezvousInfo:
        had_store = self._shared_tcp_store_server is not None
        info = super().next_rendezvous()
        addr = self._this_node.addr
        if info.rank == 0:
            if had_store:  # torch would reuse the last round's store
                self._shared_tcp_store_server = self._create_tcp_store_server(addr, 0)
            port = self._shared_tcp_store_server.port
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr.encode())
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port).encode())
            boot = RendezvousStoreInfo(addr, port)
        else:
            self._shared_tcp_store_server = None  # if this node led before, its store is done
            boot = RendezvousStoreInfo.build(info.rank, info.store, local_addr=addr)
        self._bootstrap_store_info = boot
        # For naming a node that is lost later (elastic.py).
        participants = self._state_holder.state.participants
        self._members = {n.addr: r for n, r in participants.items()}
        self._pids = {n.addr: n.pid for n in participants}
        return RendezvousInfo(info.store, info.rank, info.world_size, boot)

    settle: Any = None
    """Set by the agent (elastic.SupervisedAgent): waits a bounded time for one of this node's
    workers to exit with a failure and says whether one did."""

    def num_nodes_waiting(self) -> int:
        """torch's check for nodes waiting to join, asked by its agent while this node's workers
        look healthy (``SimpleElasticAgent._invoke_run``); an answer that the workers are about to
        contradict waits until they have settled (``settle``).

        When a peer node's worker fails, ours learn it from gloo at once but need a while to exit
        (traceback, error file, process-group teardown), and on a loaded machine the peer's agent
        can act first. torch's agent may then ask this and (a) find the peer, back in the
        rendezvous for its restart, on the wait list: torch would restart our workers as an
        admission, not counted, and the nodes' restart counts part ways (the peer later gives up,
        this node restarts into a closed rendezvous and says only "another node ended the job");
        or (b) find the rendezvous store gone with a node 0 that gave up and exited: this node
        stops with "lost the rendezvous store" instead of its own worker's failure and the
        restart limit. Either way the workers' failure is what the agent must judge: if one fails
        within the settle window the answer is 0 and torch's next ``_monitor_workers`` reports it.
        (Seen in tests/test_node_loss.py, the restart-limit test: it failed in 3 of 11 runs here,
        on (b) both times the output was kept; with worker rank 1's exit delayed 3 s, (a) and then
        (b) in every run.)"""
        try:
            n = super().num_nodes_waiting()
        except RendezvousError:
            if self.settle is not None and self.settle():
                return 0
            raise
        if n and self.settle is not None and self._only_members_waiting() and self.settle():
            return 0
        return n

    def _only_members_waiting(self) -> bool:
        """Every waiting node is one of the current round (same address and launcher pid): they
        left it to restart after a failure. A new node (a requeued host has a new launcher pid) is
        an admission, which torch's restart is for, and which the members join on its way."""
        pids = getattr(self, "_pids", {})
        return all(pids.get(n.addr) == n.pid for n in self._state_holder.state.wait_list)

    def members(self) -> dict[str, int]:
        """``{node address: rendezvous rank}`` as of the last rendezvous."""
        return dict(self._members)

    def launcher_pids(self) -> dict[str, int]:
        """``{node address: pid of its agent}``: a new pid at an address is a restarted node."""
        return dict(getattr(self, "_pids", {}))

    def get_backend(self) -> str:
        return BACKEND  # torch's registry checks that the handler names the backend asked for


# What torch pickles as the rendezvous state (``_RendezvousState``: node descriptors, datetimes of
# the deadline and keep-alives), found by pickling a full state; nothing else may be resolved.
_STATE_GLOBALS = frozenset({
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta"),
})


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _STATE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


class CheckedBackend(RendezvousBackend):
    """torch's C10dRendezvousBackend, with every state it reads checked before torch sees it.

    torch's state holder (``_BackendRendezvousStateHolder.sync``) runs plain ``pickle.loads`` on
    the state in the store, in every node's launcher, and anyone who reaches a store can write it
    (SECURITY.md): a crafted state would run code there. Each state read is first unpickled with
    :class:`_StateUnpickler`, which resolves only the classes torch's state is made of, so what
    torch then loads can construct nothing else; a state that fails is refused in one line.
    """

    def __init__(self, inner: RendezvousBackend, endpoint: str):
        self._inner, self._endpoint = inner, endpoint

    @property
    def name(self) -> str:
        return self._inner.name

    def _checked(self, result):
        if result is not None:
            try:
                _StateUnpickler(io.BytesIO(result[0])).load()
            except Exception as e:  # any malformed pickle, not only a forbidden global
                raise RendezvousStateError(
                    f"refused the rendezvous state in the store at {self._endpoint}: it is not "
                    f"torch's ({type(e).__name__}: {e}); something other than this job's "
                    f"launchers wrote it: keep the store's address private (SECURITY.md)") from None
        return result

    def get_state(self):
        return self._checked(self._inner.get_state())

    def set_state(self, state: bytes, token=None):
        return self._checked(self._inner.set_state(state, token))


def _rendezvous_store(params, listeners: Listeners):
    """The rendezvous TCPStore: served from our socket on the host node, dialled elsewhere.

    Same arguments as torch's ``_create_tcp_store`` (multi-tenant, read_timeout), but no
    "try to host, else connect" guess: which node hosts is decided by ``--node-rank``.
    """
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    try:
        if params.get_as_bool("is_host"):
            return dist.TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout,
                                 master_listen_fd=listeners._take("rdzv_socket"))
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    except (ValueError, RuntimeError, TimeoutError) as exc:
        raise RendezvousConnectionError(f"cannot reach the rendezvous store at {params.endpoint} "
                                        f"({exc})") from exc


def create_handler(params):
    """torch's c10d rendezvous handler on the listeners :func:`plan` bound for this run."""
    with _LOCK:
        listeners = _PLANS.get(params.run_id)
    if listeners is None:
        raise LaunchError(f"no listeners were bound for run {params.run_id}; start jobs with "
                          f"allhands.launch.launch")
    # Every value torch's rendezvous and agents read from the store (the pickled state, the
    # worker store's address, the rank assignments) carries a MAC under the job secret.
    store = sealed(_rendezvous_store(params, listeners), listeners.secret,
                   f"rendezvous store at {params.endpoint}")
    backend = CheckedBackend(C10dRendezvousBackend(store, params.run_id), params.endpoint)

    def seconds(key: str) -> timedelta | None:
        value = params.get_as_int(key)
        return None if value is None else timedelta(seconds=value)

    handler = NarrowRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr,
        RendezvousTimeout(seconds("join_timeout"), seconds("last_call_timeout"),
                          seconds("close_timeout"), seconds("heartbeat_timeout")),
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )
    handler.listeners = listeners
    return handler


def register() -> None:
    """Make :data:`BACKEND` known to torch's handler registry (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, create_handler)


# --------------------------------------------------------------------------- a store of its own


def serve_store(bind: str, port: int, *, stop: threading.Event | None = None) -> None:
    """Serve a rendezvous TCPStore on ``bind:port`` until SIGTERM/SIGINT (or ``stop`` is set).

    The same store torch's c10d backend creates on its host node (``_create_tcp_store``:
    multi-tenant, libuv), on a socket bound to one address as every other listener here. Jobs
    reach it with ``--rdzv-store external --rdzv-endpoint ADDR:PORT`` on every node; its state is
    torch's rendezvous state of every job that uses it, under each job's run id.
    """
    if is_wildcard(bind):
        print(f"allhands: warning: --bind {bind} listens on all interfaces: any host that can "
              f"route here reaches the rendezvous store; only the job secret keeps strangers out "
              f"of the job", file=sys.stderr, flush=True)
    sock = bind_socket(bind, port, "rendezvous store")
    addr, bound = sock.getsockname()[:2]
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: stop.set())
    try:
        store = dist.TCPStore(_dialable(addr), bound, is_master=True, wait_for_workers=False,
                              multi_tenant=True, timeout=timedelta(seconds=60),
                              master_listen_fd=sock.detach())
    except (RuntimeError, ValueError) as e:
        raise LaunchError(f"cannot serve the rendezvous store on {_hostport(addr, bound)} ({e})") from None
    print(f"allhands: listening on {_hostport(addr, bound)} (rendezvous store); serving until "
          f"stopped (SIGTERM/SIGINT); start each node with --rdzv-store external --rdzv-endpoint "
          f"{_hostport(_dialable(addr), bound)}; no admission here: the workers prove the job "
          f"secret", file=sys.stderr, flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        del store
    print("allhands: rendezvous store stopped", file=sys.stderr, flush=True)
