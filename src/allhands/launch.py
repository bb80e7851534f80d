"""Starting workers: torch's elastic launcher (``torch.distributed.launcher.api``) with our
environment fixes, the run directory, and a one-line failure summary.

This module and config.py are the only readers of environment variables. Single-host jobs bind
to loopback (``GLOO_SOCKET_IFNAME=lo``, rendezvous at 127.0.0.1 on a free port); multi-node jobs
use torch's c10d rendezvous at ``--rdzv-endpoint``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import socket
import struct
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from allhands.config import Config, to_toml, validate
from allhands.errors import AllhandsError, ConfigError, LaunchError


# --------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    local_rank: int
    world_size: int
    launched: bool


def worker_env() -> WorkerEnv:
    """Rank and world size as torch's launcher set them (0/0/1 when run in-process)."""
    e = os.environ
    launched = "RANK" in e and "WORLD_SIZE" in e and "MASTER_ADDR" in e
    return WorkerEnv(int(e.get("RANK", 0)), int(e.get("LOCAL_RANK", 0)), int(e.get("WORLD_SIZE", 1)),
                     launched)


def gloo_interface() -> str | None:
    """The interface gloo was pointed at (``_environment_fixes``), for its traffic counters."""
    return os.environ.get("GLOO_SOCKET_IFNAME")


def run_training(cfg: Config, job: Any = None) -> dict[str, Any]:
    """Train in this process as one worker of the job the environment describes."""
    from allhands.mesh import Mesh
    from allhands.trainer import Job, Trainer

    env = worker_env()
    p = cfg.parallel
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                      device=cfg.run.device, backend=p.backend, dp_replicate=p.dp_replicate,
                      timeout_s=p.timeout_s)
    try:
        return Trainer(cfg, job or Job(), mesh, Path(cfg.run.dir)).fit()
    finally:
        mesh.destroy()


def _worker_main(cfg_dict: dict, job: Any) -> None:
    """Entry point of each spawned worker (module level so that spawn can pickle it)."""
    with reported_failures():
        run_training(Config.from_dict(cfg_dict), job)


@contextlib.contextmanager
def reported_failures():
    """In a launched worker: write torch's error file for any exception, so the launcher's
    summary names the cause; user-caused errors then exit without a traceback."""
    _worker_setup()
    try:
        yield
    except AllhandsError as e:
        if worker_env().launched:
            _record_error(e)
            sys.exit(e.exit_code)
        raise
    except Exception as e:
        if worker_env().launched:
            _record_error(e)
        raise


def _worker_setup() -> None:
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)


def _record_error(e: BaseException) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(e)


# --------------------------------------------------------------------------- launcher side


def default_nproc() -> int:
    import torch

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
    max_restarts: int = 0
    run_id: str = ""

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
        if s.nnodes > 1 and not s.rdzv_endpoint:
            raise ConfigError("--rdzv-endpoint: required with --nnodes > 1, e.g. node0:29400")
        if s.rdzv_endpoint and not s.rdzv_endpoint.rpartition(":")[2].isdigit():
            raise ConfigError(f"--rdzv-endpoint: {s.rdzv_endpoint!r} is not HOST:PORT")
        return s


def _environment_fixes(spec: LaunchSpec, threads: int) -> None:
    """Environment the workers inherit; set here so that users never have to."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if not spec.multi_node:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    elif spec.local_addr and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = interface_of(spec.local_addr)
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    # These two log each worker failure with a traceback of the *agent*; failure_summary()
    # says the same in one line with the worker's own cause.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def launch(entrypoint: Callable | str, args: tuple, spec: LaunchSpec, *, threads: int = 0,
           log_dir: Path | None = None) -> None:
    """Run ``entrypoint(*args)`` (or the program ``entrypoint args...``) on every worker.

    Raises LaunchError with one line per failed rank when any worker fails.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    spec = spec.validated()
    _environment_fixes(spec, threads or max(1, (os.cpu_count() or 1) // spec.nproc))
    if spec.multi_node:
        endpoint = spec.rdzv_endpoint
        host, _, port = endpoint.rpartition(":")
        # is_host explicit on every node: left unset, torch guesses it from the host name, and a
        # node that starts first on the endpoint's machine (nodes sharing a host, as in tests)
        # takes the port before node 0 does.
        rdzv_configs: dict[str, Any] = {"timeout": 900, "is_host": spec.node_rank == 0}
        if spec.node_rank == 0:
            check_port_free(spec.local_addr or "0.0.0.0", int(port))
    else:
        if spec.port:
            check_port_free("127.0.0.1", spec.port)
        endpoint = f"127.0.0.1:{spec.port or free_port()}"
        rdzv_configs = {"timeout": 60}
    config = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc,
        run_id=spec.run_id or _default_run_id(spec), rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs, max_restarts=spec.max_restarts, monitor_interval=0.1,
        start_method="spawn", local_addr=spec.local_addr or None,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir) if log_dir else None),
    )
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        raise LaunchError(failure_summary(e)) from None


def _default_run_id(spec: LaunchSpec) -> str:
    """Every node of one job must present the same rendezvous run id; a single node needs a
    fresh one so that a stale store entry can never be mistaken for this job's."""
    if spec.multi_node:
        return "allhands-" + hashlib.sha256(spec.rdzv_endpoint.encode()).hexdigest()[:12]
    return uuid.uuid4().hex[:12]


def failure_summary(e: Any) -> str:
    """'worker rank R (pid P) failed: cause' for the first failure and any other rank that raised;
    ranks the agent merely terminated after the first failure are left out."""
    first_rank, _ = e.get_first_failure()
    lines = []
    for rank, f in sorted(e.failures.items(), key=lambda kv: (kv[0] != first_rank, kv[0])):
        raised = isinstance(f.message, dict)
        if rank != first_rank and not raised:
            continue
        if raised:
            msg = str(f.message.get("message", "")).strip().splitlines()[0]
        elif f.exitcode < 0:
            msg = f"killed by {f.signal_name()}"
        else:
            msg = f"exited with code {f.exitcode} (its output above says why)"
        lines.append(f"worker rank {rank} (pid {f.pid}) failed: {msg}")
    return "; ".join(lines)


# --------------------------------------------------------------------------- the run directory


def resolve_run(cfg: Config, *, resume: str | None, world_size: int, multi_node: bool = False,
                write: bool = True) -> Config:
    """Validate, settle the run directory and data path; ``write`` creates the directory and
    config.resolved.toml (the launcher, or rank 0 of a launched script)."""
    from allhands.data import prepare_embedded

    validate(cfg, world_size=world_size)
    cfg = Config.from_dict(cfg.to_dict())
    if multi_node and not (resume or cfg.run.dir):
        raise ConfigError("run.dir: a multi-node job needs one run directory on a filesystem every "
                          "node shares; pass --set run.dir=/shared/path")
    if resume:
        run_dir = Path(resume)
    elif cfg.run.dir:
        run_dir = Path(cfg.run.dir)
        if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
            raise ConfigError(f"run.dir: {str(run_dir)!r} already holds checkpoints; continue it "
                              f"with --resume {run_dir} or choose another run.dir")
    else:
        run_dir = Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while run_dir.exists():
            n += 1
            run_dir = run_dir.with_name(run_dir.name.split("+")[0] + f"+{n}")
    run_dir = run_dir.resolve()
    cfg.run.dir = str(run_dir)
    if not cfg.data.path:
        cfg.data.path = str(prepare_embedded(_cache_dir() / "embedded-corpus-v1"))
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.resolved.toml").write_text(to_toml(cfg))
    return cfg


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "allhands"


def train_job(cfg: Config, spec: LaunchSpec, job: Any = None, resume: str | None = None) -> Config:
    """Launcher side of ``allhands train``: resolve, then start every worker of this node."""
    spec = spec.validated()
    if cfg.run.threads == 0:
        cfg = Config.from_dict(cfg.to_dict())
        cfg.run.threads = max(1, (os.cpu_count() or 1) // spec.nproc)
    cfg = resolve_run(cfg, resume=resume, world_size=spec.nproc * spec.nnodes,
                      multi_node=spec.multi_node)
    print(f"allhands: run directory {cfg.run.dir} ({spec.nnodes} node(s) x {spec.nproc} worker(s))",
          file=sys.stderr, flush=True)
    launch(_worker_main, (cfg.to_dict(), job), spec, threads=cfg.run.threads,
           log_dir=Path(cfg.run.dir) / "logs")
    return cfg
