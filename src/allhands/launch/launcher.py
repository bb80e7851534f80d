"""Starting workers: torch's elastic launcher with our environment fixes, narrow listeners,
the job secret handed to the workers, and a one-line failure summary.

With env.py, the one place that touches environment variables. Single-host jobs bind to
loopback (``GLOO_SOCKET_IFNAME=lo``, rendezvous at 127.0.0.1 on a free port); multi-node jobs
use torch's c10d rendezvous at ``--rdzv-endpoint``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters

from allhands import admission, safefs, env as envs
from allhands.authstore import IntrusionError
from allhands.config import Config, replica_group_size, validate
from allhands.errors import ConfigError, Interrupted
from allhands.launch import forkstart, rendezvous, stop
from allhands.launch.elastic import node_label, run_agent
from allhands.launch.rendezvous import Timeouts
from allhands.launch.policy import RestartPolicy
from allhands.launch.rundir import removed_if_unstarted, resolve_run
from allhands.launch.spec import (LaunchSpec, _check_security_args, check_bind, check_port_free,
                                  default_nproc, free_port, interface_of)
from allhands.launch.supervisor import supervise
from allhands.plan.auto import fit

# what callers import from here (launch/spec.py holds them)
__all__ = ["LaunchSpec", "check_bind", "check_port_free", "default_nproc", "free_port", "interface_of",
           "launch", "train_job", "_check_security_args"]


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (Slurm's or taskset's), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_threads(nproc: int) -> int:
    """``run.threads = 0``: the usable cores shared by this node's ``nproc`` workers. Not
    ``os.cpu_count()``: a Slurm job given 16 of a host's 224 cores would run 8 workers x 28
    threads on those 16, each thread waiting for a core most of the time."""
    return max(1, usable_cores() // nproc)


def oversubscribed(nproc: int, cores: int) -> str | None:
    """The one warning for more workers on this node than cores, else None: every step waits
    for the slowest worker, and each gets a share of a core, so steps slow down by about
    ``nproc / cores`` over what the same job would take on enough cores."""
    if nproc <= cores:
        return None
    return (f"allhands: warning: {nproc} workers on {cores} core(s): each gets about "
            f"{cores / nproc:.2g} of a core and every step waits for the slowest; set --nproc "
            f"{cores} or expect slow steps")


# Entries of torch's NCCL flight recorder: the last collectives of every process group, enough
# to see which one a rank was stuck in (torch's own default where it records at all).
FLIGHT_RECORDER_ENTRIES = 2000
# The recorder's variables: (the name torch 2.11 and later read first, the older name). torch
# 2.13 still reads the older names but warns in every worker that they are deprecated; releases
# from before the recorder became backend-neutral (2025) know only the older ones, which are
# used below 2.11, the first release seen with the new names.
_FR_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FR_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_env(log_dir: Path, environ: Any) -> dict[str, str]:
    """The variables that make a NCCL collective timeout dump each rank's flight recorder (its
    recent collectives, which ``python -m torch.distributed.flight_recorder.fr_trace`` reads) to
    ``log_dir/nccl_trace_rank_<rank>``, the run's logs, instead of /tmp on whichever node timed
    out. Each is left out where the user set it (under either name). A gloo job ignores them."""
    new = 0 if torch.__version__ >= "2.11" else 1
    out: dict[str, str] = {}
    if not set(_FR_BUFFER) & set(environ):
        out[_FR_BUFFER[new]] = str(FLIGHT_RECORDER_ENTRIES)
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if not set(_FR_FILE) & set(environ):
        out[_FR_FILE[new]] = str(log_dir / "nccl_trace_rank_")
    return out


def socket_interfaces(spec: LaunchSpec, environ: Any) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for the workers. One node: loopback (NCCL's
    unless the user chose one). Many: the interface of ``--bind``, else of ``--local-addr``, the
    address the other nodes reach, for both, unless the user set GLOO_SOCKET_IFNAME (then both
    are theirs) or NCCL_SOCKET_IFNAME; left alone, NCCL's bootstrap picks an interface of its own
    (the first that is not loopback or a container bridge), which need not be one the other
    nodes can reach."""
    if not spec.multi_node:
        return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": environ.get("NCCL_SOCKET_IFNAME", "lo")}
    if "GLOO_SOCKET_IFNAME" in environ:
        return {}
    ifname = next((interface_of(a) for a in (spec.bind, spec.local_addr) if a and interface_of(a)), None)
    if not ifname:
        return {}
    return {"GLOO_SOCKET_IFNAME": ifname,
            **({} if "NCCL_SOCKET_IFNAME" in environ else {"NCCL_SOCKET_IFNAME": ifname})}


@contextlib.contextmanager
def _environment(values: dict[str, str | None]):
    """Set ``values`` (None: unset) for the workers started inside, and restore what was there
    afterwards: a process that runs several jobs must not hand one job's settings to the next."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        _set_environ(values)
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _environment_fixes(spec: LaunchSpec, threads: int) -> None:
    """Environment the workers inherit; set here so that users never have to."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # torch.compile's caches (inductor's kernels, FX graphs, AOTAutograd) default to the
    # temporary directory, which is this job's private one and goes when it ends: a restart or
    # the next job would compile from zero. This user's cache directory outlives the job.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        inductor = envs.cache_dir() / "inductor"
        inductor.mkdir(mode=0o700, parents=True, exist_ok=True)  # it holds code that is loaded
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    # torch's agent turns these signals into SignalException and a SIGTERM of its workers; SIGINT,
    # SIGTERM and SIGUSR1 are the launcher's own, a clean stop at a step boundary (stop.py).
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    # These two log each worker failure with a traceback of the *agent*; describe_failures()
    # says the same in one line with the worker's own cause.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def _quiet_intrusions_in_threads() -> None:
    """torch's rendezvous keep-alive runs in a timer thread; a forged record it reads raises
    IntrusionError there, which authstore has already said in one line: no thread traceback on
    top of it. Every other exception of a thread keeps Python's hook."""
    if getattr(threading.excepthook, "_allhands", False):
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not isinstance(args.exc_value, IntrusionError):
            previous(args)

    hook._allhands = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def launch(entrypoint: Callable | str, args: tuple, spec: LaunchSpec, *, threads: int = 0,
           log_dir: Path | None = None, policy: Any = None, run_dir: Path | None = None,
           timeouts: Any = None, checkpoints: Path | None = None,
           resume_dir: Path | None = None) -> None:
    """Run ``entrypoint(*args)`` (or the program ``entrypoint args...``) on every worker, under
    supervision (supervisor.py, policy.py): failures are named as they happen and restarted per ``policy``.
    ``checkpoints``: where a restart of a single-node job resumes from, said in its restart line
    and ``restarts.jsonl``, when not ``run_dir/checkpoints`` (launch/psgroups.py); ``resume_dir``:
    the run directory ``--resume`` takes, when ``run_dir`` is a world's own directory inside it
    (a replica group's or a parameter-server world's).

    Raises LaunchError with one line per failed rank when the job fails for good, and
    Interrupted with one line when SIGINT, SIGTERM or SIGUSR1 stopped it (stop.py).
    """
    spec = spec.validated()
    if warning := oversubscribed(spec.nproc, usable_cores()):
        print(warning, file=sys.stderr, flush=True)
    _environment_fixes(spec, threads or worker_threads(spec.nproc))
    _quiet_intrusions_in_threads()
    # Before the private temporary directory: the forkserver outlives this job (the next one in
    # this process reuses it) and multiprocessing puts its socket in the temporary directory.
    # A script's workers are spawned (run_agent), so a server would only import torch in vain
    # and hold the launcher's output open for seconds after it exits.
    if callable(entrypoint):
        forkstart.ensure_server()
    policy = policy or script_policy(spec)  # a script's: the same restart default as `train`

    def attempt(n: int, heartbeat_dir: Path) -> None:
        # The workers inherit these; worker_env() reads them back.
        os.environ["ALLHANDS_ATTEMPT"] = str(n)
        os.environ["ALLHANDS_HEARTBEAT_DIR"] = str(heartbeat_dir)
        os.environ["ALLHANDS_STARTED_AT"] = repr(time.time())  # rank 0 says a slow start
        os.environ["ALLHANDS_LAUNCHER_PID"] = str(os.getpid())  # a forked worker's parent is not
        envs.pass_verbose(spec.verbose)  # --verbose: the workers say every phase, from the command
        _launch_once(entrypoint, args, spec, log_dir=log_dir,
                     policy=policy if spec.multi_node else None, heartbeat_dir=heartbeat_dir,
                     run_dir=run_dir, timeouts=timeouts)

    # Multi-node: torch's agent restarts (it re-rendezvouses every node); single node: we do.
    # Every temporary file of the launcher, torch's spawner (the pickled traceback of a failed
    # worker it reads back) and the workers goes to a directory only this user can enter, and
    # everything the job writes is the user's alone (safefs.py).
    recorder = flight_recorder_env(log_dir, os.environ) if log_dir is not None else {}
    with safefs.private_tmp(), safefs.private_umask(), stop.handling(), _environment(recorder):
        if log_dir is not None:  # where a NCCL timeout dumps: made before any rank can time out
            log_dir.mkdir(parents=True, exist_ok=True)
        try:
            supervise(attempt, policy, run_dir=run_dir, restart_here=not spec.multi_node,
                      checkpoints=checkpoints, resume_dir=resume_dir)
            if stop.CURRENT.signum:  # the workers ended (the last step, or a signal before they
                raise stop.Stopped(stop.CURRENT.signum, clean=True)  # could handle it): say so
        except stop.Stopped as s:
            command = stop.resume_command(spec, run_dir) if run_dir is not None else None
            raise Interrupted(stop.final_line(s, run_dir, command), stop.exit_code(s.signum)) from None


def _launch_once(entrypoint: Callable | str, args: tuple, spec: LaunchSpec, *,
                 log_dir: Path | None, policy: Any = None, heartbeat_dir: Path | None = None,
                 run_dir: Path | None = None, timeouts: Any = None) -> None:
    """One run of torch's elastic agent with a fresh rendezvous; with a ``policy`` (multi-node)
    the agent restarts the workers itself (elastic.py). A failure is a WorkerFailure."""
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
    secret = admission.job_secret(multi_node=spec.multi_node, secret_file=spec.secret_file,
                                  insecure=spec.insecure, env=os.environ)
    listeners = rendezvous.plan(run_id=run_id, multi_node=spec.multi_node,
                                node_rank=spec.node_rank, rdzv_endpoint=spec.rdzv_endpoint,
                                local_addr=spec.local_addr, bind=spec.bind, port=spec.port,
                                external_store=spec.rdzv_store == "external",
                                **({"timeouts": timeouts} if timeouts else {}))
    listeners.secret = secret  # the rendezvous store's values are MAC'd under it
    env = admission.worker_environment(secret)
    # If set, torch's rank-0 *worker* hosts a second store of its own, on all interfaces.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = None
    # Set for the workers only and restored afterwards: a process that launches a single-node
    # job and then a multi-node one must not pin the second to loopback.
    env.update(socket_interfaces(spec, os.environ))
    try:
        with _environment(env):
            gloo = os.environ.get("GLOO_SOCKET_IFNAME") or "the host name's address"
            admitted = ("workers must prove the job secret" if secret
                        else "NO admission check (--insecure)")
            print(f"allhands: {listeners.describe()}; gloo on {gloo}; {admitted}", file=sys.stderr,
                  flush=True)
            yield listeners
    finally:
        listeners.close()


def _default_run_id(spec: LaunchSpec, run_dir: str = "") -> str:
    """Every node of one job must present the same rendezvous run id; a single node needs a
    fresh one so that a stale store entry can never be mistaken for this job's. An external
    store may serve several jobs at one endpoint: their run directories keep them apart. The
    endpoint's host, not its port: a store listens on one port, so its port tells no two jobs
    apart, and node 0 may be given port 0 (a free one) while the others dial the port it bound."""
    if spec.multi_node:
        key = spec.rdzv_endpoint.rpartition(":")[0] + ("\0" + run_dir if run_dir else "")
        return "allhands-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return uuid.uuid4().hex[:12]


def train_job(cfg: Config, spec: LaunchSpec, job: Any = None, resume: str | None = None) -> Config:
    """Launcher side of ``allhands train``: resolve, then start every worker of this node."""
    spec = spec.validated()
    # The workers' server first: forked from this process (forkstart.py), it must be before
    # anything below can initialise CUDA here (the memory check reads the GPU's properties).
    forkstart.ensure_server()
    if cfg.run.threads == 0:
        cfg = Config.from_dict(cfg.to_dict())
        cfg.run.threads = worker_threads(spec.nproc)
    # The layout chosen (parallel.layout=auto) and its memory checked on the devices found,
    # before the run directory is made: a job that cannot fit leaves nothing behind.
    cfg = fit(cfg, nproc=spec.nproc, nnodes=spec.nnodes, own_model=getattr(job, "model", None) is not None,
              say=lambda line: print(line, file=sys.stderr, flush=True))
    # one node only: on many, another node may be using the directory this one made
    fresh = not (resume or spec.multi_node or (cfg.run.dir and Path(cfg.run.dir).exists()))
    cfg = resolve_run(cfg, resume=resume, world_size=spec.nproc * spec.nnodes,
                      multi_node=spec.multi_node)
    with removed_if_unstarted(Path(cfg.run.dir), created=fresh):
        _start(cfg, spec, job)
    return cfg


def _start(cfg: Config, spec: LaunchSpec, job: Any) -> None:
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
    policy = restart_policy(cfg, spec)
    print(policy.describe(spec.multi_node), file=sys.stderr, flush=True)
    # A launcher per group or world: their directories and files private from here (safefs.py).
    if cfg.fault.mode == "replica" and cfg.parallel.sync == "ps":  # each ps worker restarts alone
        from allhands.launch.psgroups import run_ps_groups  # start-up time, as below

        with safefs.private_umask():
            return run_ps_groups(cfg, spec, job, launch=launch, entry=worker_entry, policy=policy)
    if cfg.fault.mode == "replica" and spec.nproc * spec.nnodes > 1:  # each group restarts alone
        from allhands.launch.replica_nodes import run_replica_nodes  # start-up time: the trainer's modules
        from allhands.launch.replicas import run_replicas

        per = replica_group_size(cfg.parallel, spec.nproc)  # FSDP inside a group: dp_shard ranks
        run = run_replica_nodes if spec.multi_node else run_replicas  # across nodes: one store on node 0
        with safefs.private_umask():
            run(cfg, spec.nproc // per, job, launch=launch, entry=worker_entry,
                group_spec=dataclasses.replace(spec, nproc=per, port=0, run_id=""), policy=policy)
        return
    launch(worker_entry, (cfg.to_dict(), job), spec, threads=cfg.run.threads,
           log_dir=Path(cfg.run.dir) / "logs", policy=policy,
           run_dir=Path(cfg.run.dir), timeouts=rendezvous_timeouts(cfg))


def worker_entry(cfg_dict: dict, job: Any) -> None:
    """The workers' entry point, importing the worker (the trainer, DCP) only in the workers:
    the launcher never trains, and every command that launches starts a second sooner."""
    from allhands.worker import worker_main

    worker_main(cfg_dict, job)


def rendezvous_timeouts(cfg: Config):
    """How long a multi-node (re-)rendezvous waits, from ``fault.*`` (README, "Losing a node")."""
    f = cfg.fault
    return Timeouts(join_s=f.rdzv_join_timeout_s, last_call_s=f.rdzv_last_call_s, node_s=f.node_timeout_s)


def script_policy(spec: LaunchSpec) -> RestartPolicy:
    """A script's: a training job's (fault.*), no hang watchdog (it beats only in allhands.train)."""
    return dataclasses.replace(restart_policy(Config(), spec), hang_timeout_s=0.0)


def restart_policy(cfg: Config, spec: LaunchSpec) -> RestartPolicy:
    """The job's restart policy from ``fault.*``; ``--max-restarts``, when given, wins."""
    f = cfg.fault
    restarts = spec.max_restarts if spec.max_restarts >= 0 else f.max_restarts
    return RestartPolicy(max_restarts=restarts, backoff_s=f.backoff_s, hang_timeout_s=f.hang_timeout_s,
                         first_step_timeout_s=f.first_step_timeout_s)
