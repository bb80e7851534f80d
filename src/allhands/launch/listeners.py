"""Where a node listens: the rendezvous store's and the worker store's sockets, bound to one
address before the launch (never to all interfaces), and the rendezvous timeouts.

torch 2.13's two TCPStores per job listen on ``[::]`` whatever host they are given: the
rendezvous store and the store the workers share. A socket bound here and handed to
``TCPStore(master_listen_fd=)`` makes a store listen on that address only. Binding before
``elastic_launch`` also makes a busy port one clear error, with no window between choosing a
free port and binding it; rendezvous.py looks the sockets up by run id when torch asks for the
handler.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from allhands.errors import ConfigError, LaunchError

BACKEND = "allhands-c10d"
"""Registry name of the narrow c10d handler (``LaunchConfig.rdzv_backend``)."""

_WILDCARDS = ("0.0.0.0", "::", "")
_PLANS: dict[str, "Listeners"] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Timeouts:
    """How long a multi-node rendezvous waits (config ``fault.*``); torch's defaults are a 600 s
    join, a 30 s last call and 5 s x 3 keep-alives."""

    join_s: float = 900.0
    """A (re-)rendezvous with fewer than MIN nodes fails after this long."""
    last_call_s: float = 10.0
    """With MIN nodes joined (MIN < MAX), wait this long for more before starting."""
    node_s: float = 15.0
    """A node whose agent sent no keep-alive for this long is dropped (a lost host)."""

    def configs(self) -> dict[str, Any]:
        # torch takes whole seconds; a node is dead after keep_alive_interval x max_attempt.
        interval = max(1, round(self.node_s / 3))
        return {"join_timeout": max(1, round(self.join_s)),
                "last_call_timeout": max(1, round(self.last_call_s)),
                "keep_alive_interval": interval, "keep_alive_max_attempt": 3}


def is_wildcard(addr: str) -> bool:
    return addr in _WILDCARDS


def resolve(host: str, flag: str = "--rdzv-endpoint") -> str:
    """The first address ``host`` resolves to (an IP literal is returned as is)."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ConfigError(f"{flag}: cannot resolve host {host!r} ({e.strerror or e}); "
                          f"pass an IP address or a resolvable name") from None


def bind_socket(addr: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound (not yet listening) to ``addr:port``; TCPStore's libuv server calls
    listen on it. SO_REUSEADDR as torch's own listener, so a restarted job can rebind at once."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and addr == "::":
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # explicit wildcard: v4 too
        s.bind((addr, port))
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise LaunchError(f"port {port} on {addr} is in use ({e.strerror}); pass a free port "
                              f"(--port / --rdzv-endpoint) or stop what holds it") from None
        raise LaunchError(f"cannot listen for the {what} on {_hostport(addr, port)} "
                          f"({e.strerror or e}); pass an address of this host (--bind / "
                          f"--local-addr)") from None
    s.set_inheritable(False)
    return s


def _hostport(addr: str, port: int | str) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


@dataclass
class Listeners:
    """What this node listens on, bound before the launch, and how torch reaches it."""

    backend = BACKEND

    run_id: str
    endpoint: str
    """HOST:PORT every agent dials for the rendezvous store."""
    local_addr: str | None
    """This node's address as published to the workers (MASTER_ADDR when it hosts the store)."""
    rdzv_socket: socket.socket | None
    """The rendezvous store's socket: only on the node that hosts it."""
    store_socket: socket.socket
    """The worker store's socket: used if this node's agent becomes rendezvous rank 0."""
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    external: bool = False
    """The rendezvous store is an ``allhands rendezvous-store`` process, not node 0's agent."""
    secret: str | None = field(default=None, repr=False)
    """The job secret: every value of the rendezvous store carries a MAC under it (authstore.py);
    None with --insecure."""

    def describe(self) -> str:
        """One line for stderr: every listener this node opens, and where."""
        parts = []
        if self.rdzv_socket is not None:
            parts.append(f"{_hostport(*self.rdzv_socket.getsockname()[:2])} (rendezvous store)")
        store = _hostport(*self.store_socket.getsockname()[:2])
        parts.append(f"{store} (worker store{'' if self.rdzv_socket else ', if this node leads'})")
        where = "listening on " + ", ".join(parts)
        if self.rdzv_socket is None:
            where += f"; rendezvous at {self.endpoint}"
            if self.external:
                where += " (external store: allhands rendezvous-store)"
        return "; ".join([where, *self.notes])

    def close(self) -> None:
        """Close what torch did not take over (TCPStore owns a socket once handed to it)."""
        with _LOCK:
            _PLANS.pop(self.run_id, None)
            for name in ("rdzv_socket", "store_socket"):
                s = getattr(self, name)
                if s is not None and s.fileno() != -1:
                    s.close()

    def worker_store_fd(self) -> int:
        """A listening socket for a worker store: the pre-bound one first, then a fresh one on
        the same address for every later round this node leads (see NarrowRendezvousHandler)."""
        with _LOCK:
            s = self.store_socket
            if s.fileno() != -1:
                self._store_addr = s.getsockname()[0]
                return s.detach()
        return bind_socket(self._store_addr, 0, "worker store").detach()

    _store_addr = ""  # where the first worker store listened; later ones listen there too

    def _take(self, name: str) -> int:
        """Hand a socket's descriptor over to a TCPStore, which closes it."""
        with _LOCK:
            s = getattr(self, name)
            if s is None or s.fileno() == -1:
                raise LaunchError(f"the {name.replace('_', ' ')} of run {self.run_id} was already "
                                  f"used; start the job again")
            return s.detach()


def _dialable(addr: str) -> str:
    """Where a client on this host reaches a listener bound to ``addr``."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(addr, addr)


# --------------------------------------------------------------------------- torch's side
