"""A network lab on one machine: K hosts as Linux network namespaces, for tests and benchmarks
that need real links between "machines".

Each host is a namespace with loopback up and one interface ``eth0`` holding ``PREFIX.(i+1)/24``,
the peer end of a veth pair whose other end is a port of one bridge in the root namespace. A
bandwidth cap puts a token-bucket filter (``tc qdisc ... tbf``) on *both* ends of each veth, so a
host's link is capped in each direction (egress of eth0 = what it sends; egress of the bridge
port = what it receives). ``mtu`` sets the links' MTU (9000 = a jumbo-frame cluster fabric,
where headers cost ~0.7% of the bytes instead of ~4.5% at 1500). Delay needs ``netem``; where the kernel has no ``sch_netem`` (as on the
machine this was written on) asking for a delay raises :class:`LabUnavailable` saying so:
tbf's ``latency`` only bounds queueing, it adds none.

Every name (namespace, veth, bridge) starts with the caller's tag plus a random per-instance
suffix, so concurrent labs never collide, and everything is removed by :meth:`Lab.close`, which
runs on leaving the ``with`` block, on garbage collection and at interpreter exit, whichever
comes first, also after a failed test. Needs root and ``iproute2``; :func:`unavailable` says why
not when it cannot work, for tests to skip with that reason.

Example::

    with Lab(2, rate_mbit=100, tag="ah5", prefix="10.55.0") as lab:
        a, b = lab.hosts
        srv = b.popen(["python", "-m", "http.server", "--bind", b.addr, "8000"])
        a.run(["curl", f"http://{b.addr}:8000/"])
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import weakref
from dataclasses import dataclass, field
from typing import Sequence


class LabUnavailable(RuntimeError):
    """The machine cannot host the lab (not root, no iproute2, no namespaces, no qdisc)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _must(cmd: Sequence[str], what: str) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise LabUnavailable(f"{what} failed: {' '.join(cmd)}: {(r.stderr or r.stdout).strip()}")


def unavailable() -> str | None:
    """Why a lab cannot be built here (for ``pytest.skip``), or None when it can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the lab tests as root, as CI does)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"ahprobe{secrets.token_hex(3)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One namespace: ``name`` to ``ip netns exec``, ``addr`` its IPv4 address on the bridge."""

    name: str
    addr: str
    iface: str = "eth0"
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(self, cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(cmd), **kw)

    def popen(self, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` in this host in its own process group (the lab kills it on close)."""
        p = subprocess.Popen(self.command(cmd), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def counters(self) -> dict[str, int]:
        """tx/rx bytes and packets of this host's interface (kernel counters)."""
        keys = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        out = self.run(["cat", *(f"/sys/class/net/{self.iface}/statistics/{k}" for k in keys)],
                       check=True).stdout.split()
        return dict(zip(keys, map(int, out)))


class Lab:
    """K hosts joined by one bridge; optional per-link bandwidth cap (both directions)."""

    def __init__(self, hosts: int = 2, *, rate_mbit: float | None = None,
                 delay_ms: float | None = None, tag: str = "ahl", prefix: str = "10.55.0",
                 burst_kb: int = 64, mtu: int = 1500):
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts={hosts}: a lab has 1..200 hosts")
        # Interface names are limited to 15 characters: tag (<= 5) + 4 hex + role + index.
        if len(tag) > 5 or not tag.isalnum():
            raise ValueError(f"tag={tag!r}: at most 5 letters/digits (interface names are short)")
        reason = unavailable()
        if reason:
            raise LabUnavailable(reason)
        self.id = f"{tag}{secrets.token_hex(2)}"
        self.bridge = f"{self.id}br"
        self.rate_mbit = rate_mbit
        self.hosts: list[Host] = []
        self._veths: list[str] = []
        self._closed = False
        # Registered before anything exists, so a failure half-way still cleans up; a finalizer
        # also runs at interpreter exit (weakref.finalize's atexit), not only on collection.
        self._finalizer = weakref.finalize(self, Lab._teardown, self.bridge, self._veths, self.hosts)
        try:
            self._build(hosts, prefix, rate_mbit, delay_ms, burst_kb, mtu)
        except BaseException:
            self.close()
            raise

    def _build(self, k: int, prefix: str, rate: float | None, delay: float | None, burst_kb: int,
               mtu: int) -> None:
        _must(["ip", "link", "add", self.bridge, "mtu", str(mtu), "type", "bridge"], "creating the bridge")
        _must(["ip", "link", "set", self.bridge, "up"], "bringing the bridge up")
        for i in range(k):
            host = Host(name=f"{self.id}h{i}", addr=f"{prefix}.{i + 1}")
            outer, inner = f"{self.id}v{i}", f"{self.id}p{i}"
            _must(["ip", "netns", "add", host.name], "creating a namespace")
            self.hosts.append(host)
            _must(["ip", "link", "add", outer, "mtu", str(mtu), "type", "veth", "peer", "name", inner,
                   "mtu", str(mtu)], "creating a veth pair")
            self._veths.append(outer)
            _must(["ip", "link", "set", inner, "netns", host.name], "moving a veth into its namespace")
            _must(["ip", "link", "set", outer, "master", self.bridge], "attaching a veth to the bridge")
            _must(["ip", "link", "set", outer, "up"], "bringing a veth up")
            ns = ["ip", "netns", "exec", host.name]
            _must([*ns, "ip", "link", "set", inner, "name", host.iface], "renaming the host interface")
            _must([*ns, "ip", "addr", "add", f"{host.addr}/24", "dev", host.iface], "addressing a host")
            _must([*ns, "ip", "link", "set", host.iface, "up"], "bringing a host interface up")
            _must([*ns, "ip", "link", "set", "lo", "up"], "bringing a host's loopback up")
            if delay:
                _must([*ns, "tc", "qdisc", "add", "dev", host.iface, "root", "netem", "delay",
                       f"{delay}ms"], "adding a delay (needs the sch_netem kernel module)")
            if rate:
                tbf = ["tbf", "rate", f"{rate}mbit", "burst", f"{burst_kb}kb", "latency", "50ms"]
                if delay:  # netem is the root then; tbf shapes under it
                    _must([*ns, "tc", "qdisc", "add", "dev", host.iface, "parent", "1:1", *tbf],
                          "capping a host's egress")
                else:
                    _must([*ns, "tc", "qdisc", "add", "dev", host.iface, "root", *tbf],
                          "capping a host's egress")
                _must(["tc", "qdisc", "add", "dev", outer, "root", *tbf], "capping a host's ingress")

    @staticmethod
    def _teardown(bridge: str, veths: list[str], hosts: list[Host]) -> None:
        for h in hosts:
            for p in h.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    p.wait()
            # Processes started some other way inside the namespace: only ours live there.
            pids = _ip("netns", "pids", h.name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", h.name, check=False)  # removes eth0 and, with it, its veth peer
        for v in veths:
            _ip("link", "del", v, check=False)
        _ip("link", "del", bridge, check=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()

    def names(self) -> list[str]:
        """Every kernel object this lab made (for tests that check nothing is left)."""
        return [self.bridge, *self._veths, *(h.name for h in self.hosts)]

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links whose names start with ``prefix`` (empty after a clean close)."""
    ns = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in _ip("-o", "link", "show", check=False).stdout.splitlines()]
    return sorted(n for n in ns + links if n.startswith(prefix))
