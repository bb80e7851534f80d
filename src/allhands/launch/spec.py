"""What a launch is asked for (``LaunchSpec``: workers, nodes, rendezvous, restarts, bind
address, secret) and the checks of it that need no process: ports, bind addresses, security
flags."""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

import torch

from allhands import admission
from allhands.errors import ConfigError, LaunchError


def default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise LaunchError(f"port {port} on {host} is in use ({e.strerror}); pass a free port "
                              f"(--port / --rdzv-endpoint) or stop what holds it") from None


def interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 ``addr`` (for GLOO_SOCKET_IFNAME), or None."""
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


@dataclass
class LaunchSpec:
    """Where and how many workers: one node by default, or a c10d multi-node rendezvous."""

    nproc: int = 0
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    local_addr: str = ""
    port: int = 0
    max_restarts: int = -1
    run_id: str = ""
    min_nodes: int = 0
    bind: str = ""
    secret_file: str = ""
    insecure: bool = False
    rdzv_store: str = "node0"
    """Who serves the rendezvous store: node 0's agent, or an ``allhands rendezvous-store``
    process every node dials (``external``), so that losing node 0 is survivable too."""
    verbose: bool = False  # say how long every start-up phase took, up to the first step

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1 or bool(self.rdzv_endpoint)

    def validated(self) -> "LaunchSpec":
        s = dataclasses.replace(self)
        if s.nproc == 0:
            s.nproc = default_nproc()
        if s.nproc < 1:
            raise ConfigError(f"--nproc: {self.nproc} is not allowed; must be >= 1")
        if s.nnodes < 1 or not 0 <= s.node_rank < s.nnodes:
            raise ConfigError(f"--node-rank: {s.node_rank} is not allowed with --nnodes {s.nnodes}; "
                              f"must be in [0, {s.nnodes})")
        if s.max_restarts < -1:
            raise ConfigError(f"--max-restarts: {s.max_restarts} is not allowed; must be >= 0")
        if not 0 <= s.min_nodes <= s.nnodes:
            raise ConfigError(f"--nnodes: minimum {s.min_nodes} is not allowed; MIN:MAX needs "
                              f"1 <= MIN <= MAX")
        if s.nnodes > 1 and not s.rdzv_endpoint:
            raise ConfigError("--rdzv-endpoint: required with --nnodes > 1, e.g. node0:29400")
        # Port 0: node 0 hosts the store on a free port and says which in its "listening on"
        # line; only the node that binds it may be given 0 (the others dial the port it said).
        hosts = s.node_rank == 0 and s.rdzv_store == "node0"
        ep_port = s.rdzv_endpoint.rpartition(":")[2]
        if s.rdzv_endpoint and not (ep_port.isdigit() and (0 if hosts else 1) <= int(ep_port) <= 65535):
            raise ConfigError(f"--rdzv-endpoint: {s.rdzv_endpoint!r} is not HOST:PORT with a port "
                              f"in [1, 65535]" + (", or 0 for a free one" if hosts else ""))
        if not 0 <= s.port <= 65535:
            raise ConfigError(f"--port: {s.port} is not allowed; must be in [1, 65535], or 0 for a "
                              f"free one")
        if s.rdzv_store not in ("node0", "external"):
            raise ConfigError(f"--rdzv-store: {s.rdzv_store!r} is not allowed; must be node0 or "
                              f"external")
        if s.rdzv_store == "external" and not s.rdzv_endpoint:
            raise ConfigError("--rdzv-store: external needs --rdzv-endpoint HOST:PORT of the "
                              "`allhands rendezvous-store` process")
        _check_security_args(s)
        return s


def check_bind(bind: str) -> None:
    """``--bind`` (train, launch, rendezvous-store) names an IP address: exit 2 otherwise."""
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise ConfigError(f"--bind: {bind!r} is not an IP address; pass one of this host's "
                          f"addresses (0.0.0.0 means every interface)") from None


def _check_security_args(s: LaunchSpec) -> None:
    """--bind is an address; a multi-node job has a usable secret (exit 2 before anything runs)."""
    if s.bind:
        check_bind(s.bind)
    if s.multi_node and not s.insecure:
        admission.job_secret(multi_node=True, secret_file=s.secret_file, insecure=False, env=os.environ)
