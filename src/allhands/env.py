"""The worker's environment as the launcher set it: rank, world size, attempt, heartbeat
directory, the job secret, the gloo interface. With the launcher, the one reader of
environment variables; worker-side code asks here instead of reading ``os.environ``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SECRET_ENV = "ALLHANDS_SECRET"
"""The job secret (multi-node: the same string on every node; single node: set by the launcher)."""
SECRET_FILE_ENV = "ALLHANDS_SECRET_FILE"
"""A file holding the job secret; must not be readable by every user."""
INSECURE_ENV = "ALLHANDS_INSECURE"
"""Set to 1 by ``--insecure``: workers skip admission."""


REPLICA_ENV = "ALLHANDS_REPLICA"
"""Replica mode (launch/replicas.py): ``GROUP,GROUPS,HOST,PORT[,ADDRESS]`` of this worker's replica
group, of the store where the groups meet, and (across nodes) this node's address for the quorum's
gloo connections."""
REPLICA_SECRET_ENV = "ALLHANDS_REPLICA_SECRET"
"""The secret every value of that store is MAC'd under (one per job, shared by its groups)."""
PS_ENV = "ALLHANDS_PS"
"""A parameter server in replica mode (launch/psgroups.py): ``GROUP,GROUPS,HOST,PORT``, this
process's group (a worker's index, or GROUPS - 1: the servers) and the store where workers and
servers link, MAC'd under the secret of ``REPLICA_SECRET_ENV``."""


@dataclass(frozen=True)
class ReplicaEnv:
    group: int
    groups: int
    host: str
    port: int
    secret: str | None
    address: str = ""  # where the quorum's gloo listens; "" for gloo's default (one node: loopback)


def replica_env() -> ReplicaEnv | None:
    """This worker's replica group and the quorum store, when launched in replica mode."""
    return _group_env(REPLICA_ENV)


def ps_env() -> ReplicaEnv | None:
    """This process's group and the link store, when a parameter server runs in replica mode."""
    return _group_env(PS_ENV)


def _group_env(name: str) -> ReplicaEnv | None:
    e = os.environ
    if not e.get(name):
        return None
    group, groups, host, port, *address = e[name].split(",")
    return ReplicaEnv(int(group), int(groups), host, int(port), e.get(REPLICA_SECRET_ENV) or None,
                      address[0] if address else "")


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    local_rank: int
    world_size: int
    launched: bool
    attempt: int = 0  # restarts before this one (ours or torch's agent's)
    heartbeat_dir: str = ""  # where the supervisor's hang watchdog expects heartbeats
    started_at: float = 0.0  # time.time() when the launcher started this attempt; 0: unknown
    launcher_pid: int = 0  # the launcher's process (a worker's parent may be its forkserver); 0: unknown
    verbose: bool = False  # --verbose: say every start-up phase, however short
    command_at: float = 0.0  # time.time() when the launcher's process started; 0: unknown


def worker_env() -> WorkerEnv:
    """Rank and world size as torch's launcher set them (0/0/1 when run in-process)."""
    e = os.environ
    launched = "RANK" in e and "WORLD_SIZE" in e and "MASTER_ADDR" in e
    attempt = int(e.get("ALLHANDS_ATTEMPT", 0)) + int(e.get("TORCHELASTIC_RESTART_COUNT", 0))
    return WorkerEnv(int(e.get("RANK", 0)), int(e.get("LOCAL_RANK", 0)), int(e.get("WORLD_SIZE", 1)),
                     launched, attempt if launched else 0,
                     e.get("ALLHANDS_HEARTBEAT_DIR", "") if launched else "",
                     float(e.get("ALLHANDS_STARTED_AT", 0) or 0) if launched else 0.0,
                     int(e.get("ALLHANDS_LAUNCHER_PID", 0) or 0) if launched else 0,
                     launched and e.get("ALLHANDS_VERBOSE") == "1",
                     float(e.get("ALLHANDS_COMMAND_AT", 0) or 0) if launched else 0.0)


def pass_verbose(verbose: bool) -> None:
    """Launcher side of --verbose: tell the workers (and say how long this process took to get
    here: python, imports, config, run directory, worker server)."""
    started = process_started_at()
    os.environ.update(ALLHANDS_VERBOSE="1" if verbose else "", ALLHANDS_COMMAND_AT=repr(started))
    if verbose:
        print(f"allhands: the launcher's start (python, imports, config, run directory, worker "
              f"server) took {time.time() - started:.3f} s", file=sys.stderr, flush=True)


def process_started_at() -> float:
    """time.time() when this process started, to 10 ms (Linux: /proc; its start in clock
    ticks after boot against the uptime now), or now where that is unknown."""
    now = time.time()
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return now


def gloo_interface() -> str | None:
    """The interface gloo was pointed at (the launcher's environment fixes), for its traffic counters."""
    return os.environ.get("GLOO_SOCKET_IFNAME")


def worker_admission_env() -> tuple[str | None, bool, tuple[str, int] | None]:
    """The job secret, whether the launcher ran with --insecure, and the worker store's address,
    as the launcher passed them to this worker (see admission.py)."""
    e = os.environ
    master = (e["MASTER_ADDR"], int(e["MASTER_PORT"])) if e.get("MASTER_PORT", "").isdigit() \
        and e.get("MASTER_ADDR") else None
    return e.get(SECRET_ENV) or None, e.get(INSECURE_ENV) == "1", master


def worker_store_env() -> tuple[str, int, bool, int]:
    """Where torch's launcher put the worker store (MASTER_ADDR, MASTER_PORT), whether the agent
    hosts it (TORCHELASTIC_USE_AGENT_STORE) and the agent's restart count, which names the
    keys of this attempt (as torch's ``env://`` rendezvous reads them)."""
    e = os.environ
    return (e["MASTER_ADDR"], int(e["MASTER_PORT"]),
            e.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            int(e.get("TORCHELASTIC_RESTART_COUNT", 0)))


def cache_dir() -> Path:
    """Per-user cache of what outlives a job (the CPU GEMM peak, the embedded corpus's shards,
    inductor's compiled kernels): ``ALLHANDS_CACHE_DIR``, else ``$XDG_CACHE_HOME/allhands``, else
    ``~/.cache/allhands``."""
    e = os.environ
    if e.get("ALLHANDS_CACHE_DIR"):
        return Path(e["ALLHANDS_CACHE_DIR"])
    return Path(e.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "allhands"
