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
    attempt: int = 0  # restarts before this one (ours or torch's agent's)
    heartbeat_dir: str = ""  # where the supervisor's hang watchdog expects heartbeats


def worker_env() -> WorkerEnv:
    """Rank and world size as torch's launcher set them (0/0/1 when run in-process)."""
    e = os.environ
    launched = "RANK" in e and "WORLD_SIZE" in e and "MASTER_ADDR" in e
    attempt = int(e.get("ALLHANDS_ATTEMPT", 0)) + int(e.get("TORCHELASTIC_RESTART_COUNT", 0))
    return WorkerEnv(int(e.get("RANK", 0)), int(e.get("LOCAL_RANK", 0)), int(e.get("WORLD_SIZE", 1)),
                     launched, attempt if launched else 0,
                     e.get("ALLHANDS_HEARTBEAT_DIR", "") if launched else "")


def gloo_interface() -> str | None:
    """The interface gloo was pointed at (``_environment_fixes``), for its traffic counters."""
    return os.environ.get("GLOO_SOCKET_IFNAME")


def run_training(cfg: Config, job: Any = None) -> dict[str, Any]:
    """Train in this process as one worker of the job the environment describes."""
    from allhands.mesh import Mesh
    from allhands.trainer import Job, Trainer

    env = worker_env()
    p = cfg.parallel
    if env.attempt:  # an elastic restart may bring fewer workers: the batch must still divide
        validate(cfg, world_size=env.world_size, need_data=False)
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                      device=cfg.run.device, backend=p.backend, dp_replicate=p.dp_replicate,
                      dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, timeout_s=p.timeout_s)
    try:
        return Trainer(cfg, job or Job(), mesh, Path(cfg.run.dir)).fit()
    finally:
        mesh.destroy()


def worker_admission_env() -> tuple[str | None, bool, tuple[str, int] | None]:
    """The job secret, whether the launcher ran with --insecure, and the worker store's address,
    as the launcher passed them to this worker (see admission.py)."""
    from allhands.admission import INSECURE_ENV, SECRET_ENV

    e = os.environ
    master = (e["MASTER_ADDR"], int(e["MASTER_PORT"])) if e.get("MASTER_PORT", "").isdigit() \
        and e.get("MASTER_ADDR") else None
    return e.get(SECRET_ENV) or None, e.get(INSECURE_ENV) == "1", master


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
    max_restarts: int = -1
    run_id: str = ""
    min_nodes: int = 0
    bind: str = ""
    secret_file: str = ""
    insecure: bool = False
    rdzv_store: str = "node0"
    """Who serves the rendezvous store: node 0's agent, or an ``allhands rendezvous-store``
    process every node dials (``external``), so that losing node 0 is survivable too."""

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
        if s.rdzv_endpoint and not s.rdzv_endpoint.rpartition(":")[2].isdigit():
            raise ConfigError(f"--rdzv-endpoint: {s.rdzv_endpoint!r} is not HOST:PORT")
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
    import ipaddress

    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise ConfigError(f"--bind: {bind!r} is not an IP address; pass one of this host's "
                          f"addresses (0.0.0.0 means every interface)") from None


def _check_security_args(s: LaunchSpec) -> None:
    """--bind is an address; a multi-node job has a usable secret (exit 2 before anything runs)."""
    from allhands.admission import job_secret

    if s.bind:
        check_bind(s.bind)
    if s.multi_node and not s.insecure:
        job_secret(multi_node=True, secret_file=s.secret_file, insecure=False, env=os.environ)


def _environment_fixes(spec: LaunchSpec, threads: int) -> None:
    """Environment the workers inherit; set here so that users never have to."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # What torch's launch_agent sets (elastic.run_agent stands in for it): the agent turns these
    # signals into a clean stop of its workers.
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    # These two log each worker failure with a traceback of the *agent*; failure_summary()
    # says the same in one line with the worker's own cause.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def launch(entrypoint: Callable | str, args: tuple, spec: LaunchSpec, *, threads: int = 0,
           log_dir: Path | None = None, policy: Any = None, run_dir: Path | None = None,
           timeouts: Any = None) -> None:
    """Run ``entrypoint(*args)`` (or the program ``entrypoint args...``) on every worker, under
    supervision (supervise.py): failures are named as they happen and restarted per ``policy``.

    Raises LaunchError with one line per failed rank when the job fails for good.
    """
    from allhands.supervise import RestartPolicy, supervise

    spec = spec.validated()
    _environment_fixes(spec, threads or max(1, (os.cpu_count() or 1) // spec.nproc))
    if policy is None:
        policy = RestartPolicy(max_restarts=max(0, spec.max_restarts))

    def attempt(n: int, heartbeat_dir: Path) -> None:
        # The workers inherit these; worker_env() reads them back.
        os.environ["ALLHANDS_ATTEMPT"] = str(n)
        os.environ["ALLHANDS_HEARTBEAT_DIR"] = str(heartbeat_dir)
        _launch_once(entrypoint, args, spec, log_dir=log_dir,
                     policy=policy if spec.multi_node else None, heartbeat_dir=heartbeat_dir,
                     run_dir=run_dir, timeouts=timeouts)

    # Multi-node: torch's agent restarts (it re-rendezvouses every node); single node: we do.
    supervise(attempt, policy, run_dir=run_dir, restart_here=not spec.multi_node)


def _launch_once(entrypoint: Callable | str, args: tuple, spec: LaunchSpec, *,
                 log_dir: Path | None, policy: Any = None, heartbeat_dir: Path | None = None,
                 run_dir: Path | None = None, timeouts: Any = None) -> None:
    """One run of torch's elastic agent with a fresh rendezvous; with a ``policy`` (multi-node)
    the agent restarts the workers itself (elastic.py). A failure is a WorkerFailure."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from allhands.elastic import node_label, run_agent
    from allhands.rendezvous import Timeouts

    timeouts = timeouts or Timeouts()
    run_id = spec.run_id or _default_run_id(spec)
    with _secured(spec, run_id, timeouts) as listeners:
        rdzv = RendezvousParameters(
            backend=listeners.backend, endpoint=listeners.endpoint, run_id=run_id,
            min_nodes=spec.min_nodes or spec.nnodes, max_nodes=spec.nnodes,
            local_addr=listeners.local_addr, **listeners.rdzv_configs)
        run_agent(spec_kw=dict(role="default", local_world_size=spec.nproc, entrypoint=entrypoint,
                               args=tuple(args), max_restarts=policy.max_restarts if policy else 0,
                               monitor_interval=0.1, local_addr=listeners.local_addr),
                  rdzv=rdzv, logs_specs=DefaultLogsSpecs(log_dir=str(log_dir) if log_dir else None),
                  policy=policy, run_dir=run_dir, heartbeat_dir=heartbeat_dir,
                  node=node_label(listeners.local_addr, spec.multi_node), node_timeout_s=timeouts.node_s,
                  external_store=listeners.external)


@contextlib.contextmanager
def _secured(spec: LaunchSpec, run_id: str, timeouts: Any = None):
    """Bind this node's listeners narrowly (rendezvous.py) and hand the job secret to the
    workers through the environment (admission.py); both undone when the job ends."""
    from allhands import admission, rendezvous

    secret = admission.job_secret(multi_node=spec.multi_node, secret_file=spec.secret_file,
                                  insecure=spec.insecure, env=os.environ)
    listeners = rendezvous.plan(run_id=run_id, multi_node=spec.multi_node,
                                node_rank=spec.node_rank, rdzv_endpoint=spec.rdzv_endpoint,
                                local_addr=spec.local_addr, bind=spec.bind, port=spec.port,
                                external_store=spec.rdzv_store == "external",
                                **({"timeouts": timeouts} if timeouts else {}))
    env = admission.worker_environment(secret)
    # If set, torch's rank-0 *worker* hosts a second store of its own, on all interfaces.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = None
    # Set for the workers only and restored afterwards: a process that launches a single-node
    # job and then a multi-node one must not pin the second to loopback.
    if not spec.multi_node:
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", "lo")
    elif "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo listens where we were told: --bind, else the address other nodes reach us at
        ifname = next((interface_of(a) for a in (spec.bind, spec.local_addr) if a and interface_of(a)), None)
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        gloo = os.environ.get("GLOO_SOCKET_IFNAME") or "the host name's address"
        admitted = ("workers must prove the job secret" if secret
                    else "NO admission check (--insecure)")
        print(f"allhands: {listeners.describe()}; gloo on {gloo}; {admitted}", file=sys.stderr,
              flush=True)
        yield listeners
    finally:
        listeners.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _default_run_id(spec: LaunchSpec, run_dir: str = "") -> str:
    """Every node of one job must present the same rendezvous run id; a single node needs a
    fresh one so that a stale store entry can never be mistaken for this job's. An external
    store may serve several jobs at one endpoint: their run directories keep them apart."""
    if spec.multi_node:
        key = spec.rdzv_endpoint + ("\0" + run_dir if run_dir else "")
        return "allhands-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return uuid.uuid4().hex[:12]


def failure_summary(e: Any, node: str | None = None) -> str:
    """'worker rank R (pid P) on node N failed: cause' for the first failure and any other rank
    that raised (``e``: torch's ChildFailedError); see elastic.describe_failures."""
    from allhands.elastic import describe_failures, first_failure

    return describe_failures(e.failures, first_failure(e.failures), node or socket.gethostname())


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
            if not (multi_node and _same_job(run_dir, cfg)):
                raise ConfigError(f"run.dir: {str(run_dir)!r} already holds checkpoints; continue it "
                                  f"with --resume {run_dir} or choose another run.dir")
            # A requeued node (or job) runs its original command again (Slurm --requeue, a
            # Kubernetes restart): it rejoins the job it belongs to, which resumes from the
            # last committed checkpoint (the workers check that checkpoint's config).
            print(f"allhands: run.dir {str(run_dir)!r} holds this job's checkpoints: this node "
                  f"rejoins it (a requeued node or job)", file=sys.stderr, flush=True)
            write = False
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


def _same_job(run_dir: Path, cfg: Config) -> bool:
    """``run_dir`` was made by this config: the same resolved config up to the fields that
    differ between hosts or launches (threads per worker)."""
    from allhands.config import load_config

    path = run_dir / "config.resolved.toml"
    if not path.is_file():
        return False
    try:
        saved = load_config(path).to_dict()
    except AllhandsError:
        return False
    now = cfg.to_dict()
    local = [("run", "threads"), ("run", "dir")] + ([] if cfg.data.path else [("data", "path")])
    for d in (saved, now):
        for sec, name in local:
            d[sec].pop(name, None)
    return saved == now


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
    for nodes in range(spec.min_nodes or spec.nnodes, spec.nnodes):
        # An elastic job may continue on fewer nodes; the same global batch (hence the same data
        # order, sampler.py) must divide at every size it can shrink to.
        try:
            validate(cfg, world_size=nodes * spec.nproc, need_data=False)
        except ConfigError as e:
            raise ConfigError(f"{e} (--nnodes {spec.min_nodes}:{spec.nnodes} may shrink the job to "
                              f"{nodes} node(s) x {spec.nproc} workers)") from None
    print(f"allhands: run directory {cfg.run.dir} ({spec.nnodes} node(s) x {spec.nproc} worker(s))",
          file=sys.stderr, flush=True)
    if spec.rdzv_store == "external" and not spec.run_id:
        spec = dataclasses.replace(spec, run_id=_default_run_id(spec, cfg.run.dir))
    launch(_worker_main, (cfg.to_dict(), job), spec, threads=cfg.run.threads,
           log_dir=Path(cfg.run.dir) / "logs", policy=restart_policy(cfg, spec),
           run_dir=Path(cfg.run.dir), timeouts=rendezvous_timeouts(cfg))
    return cfg


def rendezvous_timeouts(cfg: Config):
    """How long a multi-node (re-)rendezvous waits, from ``fault.*`` (README, "Losing a node")."""
    from allhands.rendezvous import Timeouts

    f = cfg.fault
    return Timeouts(join_s=f.rdzv_join_timeout_s, last_call_s=f.rdzv_last_call_s, node_s=f.node_timeout_s)


def restart_policy(cfg: Config, spec: LaunchSpec):
    """``--max-restarts`` (when given) wins over ``fault.max_restarts``."""
    from allhands.supervise import RestartPolicy

    f = cfg.fault
    restarts = spec.max_restarts if spec.max_restarts >= 0 else f.max_restarts
    return RestartPolicy(max_restarts=restarts, backoff_s=f.backoff_s, hang_timeout_s=f.hang_timeout_s)
