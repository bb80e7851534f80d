"""Inside a worker process: environment -> mesh -> Trainer, and the worker's failures
recorded for the launcher's one-line summary."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import datetime
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from allhands.authstore import sealed
from allhands.checkpoint import Checkpointer, committed
from allhands.checkpoint.heal import ReplicaGroup, group_dir
from allhands.config import Config, replica_group_config, validate
from allhands.env import ReplicaEnv, ps_env, replica_env, worker_env
from allhands.errors import AllhandsError
from allhands.faults import FaultInjector
from allhands.mesh import Mesh
from allhands.metrics import slow_phase
from allhands.stopflag import FLAG, CleanStop
from allhands.sync.ps_links import AnySource, Hub, Share
from allhands.sync.ps_rows import detach_tables
from allhands.sync.ps_server import serve
from allhands.sync.ps_wire import Roles, ps_roles
from allhands.sync import spares
from allhands.sync.quorum import QuorumFinished, QuorumStopped, ReplicaQuorum, shared_token
from allhands.trainer import Job, Trainer


def run_training(cfg: Config, job: Any = None) -> dict[str, Any]:
    """Train in this process as one worker of the job the environment describes."""
    env = worker_env()
    replica = replica_env()
    if replica is not None:  # fault.mode = "replica": this world is one replica group (dp_shard
        cfg = replica_group_config(cfg)  # ranks); the groups meet in the quorum, not the mesh
    p = cfg.parallel
    if env.attempt and ps_env() is None:  # an elastic restart may bring fewer workers: the batch must still divide
        validate(cfg, world_size=env.world_size, need_data=False)
    rank, world, store, roles = env.rank, env.world_size, None, None
    t = time.time()
    if env.started_at:  # the agent's rendezvous, starting this process (a fork of a preloaded server)
        _say(env.rank, slow_phase(f"starting {env.world_size} workers", t - env.started_at))
    if p.sync == "ps":  # the last ps.servers ranks serve; the workers' mesh spans the rest
        roles = ps_roles(cfg.ps.servers, env.rank, env.world_size, p.timeout_s)
        if roles.server:
            return run_ps_server(cfg, roles, env.local_rank)
        if roles.links is None:  # else (replica mode) this worker is a world of its own
            rank, world, store = roles.index, roles.size, roles.role_store
        job = ps_job(cfg, job or Job())
    mesh = Mesh.build(rank=rank, world_size=world, local_rank=env.local_rank,
                      device=cfg.run.device, backend=p.backend, dp_replicate=p.dp_replicate,
                      dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, timeout_s=p.timeout_s, store=store)
    t = _said_since(env.rank, "the workers' rendezvous (process groups)", t)
    try:
        if replica is not None:  # fault.mode = "replica": this process is one replica group
            return run_replica(cfg, job or Job(), mesh, replica)
        run_dir = Path(cfg.run.dir)
        member = p.sync == "ps" and roles.links is not None  # replica mode: a world of its own
        trainer = Trainer(cfg, job or Job(), mesh, group_dir(run_dir, roles.index) if member else run_dir)
        if member:  # its share of every batch; faults name the worker (sync/ps_links.py)
            trainer.sampler = Share(trainer.sampler, roles.index, roles.n_workers)
            trainer.faults = trainer.strategy.faults = FaultInjector(cfg.fault.inject, roles.index, run_dir)
        _said_since(env.rank, "building the data, model and layout", t)
        result = trainer.fit()
        if p.sync == "ps":  # after the last evaluation, which fetches embedding rows too
            trainer.strategy.finish()
        return result
    finally:
        mesh.destroy()


def _say(rank: int, line: str | None) -> None:
    if line and rank == 0:  # rank 0 speaks for the job, as its metrics writer does
        print(line, file=sys.stderr, flush=True)


def _said_since(rank: int, what: str, t: float) -> float:
    """Say ``what`` took since ``t`` if slow (metrics.slow_phase); returns now."""
    now = time.time()
    _say(rank, slow_phase(what, now - t))
    return now


def run_replica(cfg: Config, job: Job, mesh: Mesh, rep: ReplicaEnv) -> dict[str, Any]:
    """One replica-mode process: the group it holds (or, as a spare, is handed: sync/spares.py),
    its trainer, joined to the quorum of the groups."""
    run_dir = Path(cfg.run.dir)
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    store = sealed(dist.TCPStore(rep.host, rep.port, is_master=False, timeout=timeout), rep.secret,
                   f"replica store at {rep.host}:{rep.port}")
    life = shared_token(mesh.cpu_group() if mesh.world_size > 1 else None)  # a group's ranks share it
    spares.register(store, life)  # every rank's process, for the launcher's failure notice
    if store.check(["done"]):  # a restart that came up after the others completed the job
        return {}
    if cfg.fault.spares:  # any group whose holder died, or wait as a spare (one process a group)
        group = spares.claim(store, life, rep.group, rep.groups)
    else:  # this slot's group: its own ranks (FSDP inside a group) or, across nodes, its node's
        group = rep.group
        if mesh.rank == 0:
            store.set(f"life/{group}", life)
    where = group_dir(run_dir, group if group is not None else rep.group)
    trainer = Trainer(cfg, job, mesh, where)  # a spare too: what a replacement must not wait for
    if group is None:
        got = spares.wait_as_spare(store, life, stop=lambda: _why_not(store))
        if got == "done":
            return {}
        if isinstance(got, str):
            raise CleanStop(int(got), 0, None, run_dir)
        group, trainer.resume = got[0], not got[1]  # live peers: heal from them, load nothing
        trainer.move_to(group_dir(run_dir, group))
        print(f"allhands: replica group {group}: spare pid {os.getpid()} takes its place",
              file=sys.stderr, flush=True)
    else:
        spares.wait_for_spares(store, cfg.fault.spares, cfg.parallel.timeout_s)
    # faults name a rank as in the whole job's mesh (group G's local rank L is G * dp_shard + L;
    # G itself with one rank per group) and fire once per job
    trainer.faults = FaultInjector(cfg.fault.inject, group * mesh.world_size + mesh.rank, run_dir)
    quorum = ReplicaQuorum(store, group, rep.groups, timeout_s=cfg.fault.quorum_timeout_s,
                           dead_s=cfg.parallel.timeout_s, pg_timeout_s=cfg.parallel.timeout_s,
                           min_groups=cfg.fault.min_groups, local_group=mesh.cpu_group(),
                           secret=rep.secret, address=rep.address, life=life)
    replica = ReplicaGroup(quorum, trainer)
    try:
        result = trainer.fit()
    except QuorumFinished:  # the others completed the job while this group was joining
        return {}
    except QuorumStopped as e:  # stopped while waiting: its last checkpoint is what it has
        raise CleanStop(e.signum, trainer.train_state.step, None, run_dir) from None
    replica.finish(trainer.train_state.step)
    return result


def _why_not(store) -> str | None:
    """Why a waiting spare gives up: the job is done, or the signal number of a stop."""
    if store.check(["done"]):
        return "done"
    return store.get("stop").decode() if store.check(["stop"]) else None


def ps_job(cfg: Config, job: Job) -> Job:
    """A user's model with its embedding tables detached as soon as it is built: one built on
    the meta device is never allocated here (the trainer's ``.to(device)`` would fail on it)."""
    if job.model is None:
        return job  # the reference GPT's tables are detached when the strategy wraps it
    build = job.model
    return dataclasses.replace(job, model=lambda c: _detached(build(c), c.ps.sparse))


def _detached(model, sparse: str):
    detach_tables(model, sparse)
    return model


def run_ps_server(cfg: Config, roles: Roles, local_rank: int) -> dict[str, Any]:
    """A parameter server (sync/ps_server.py): its shard saved beside the workers' checkpoints."""
    p, run_dir = cfg.parallel, Path(cfg.run.dir)
    mesh = Mesh.build(rank=roles.index, world_size=roles.size, local_rank=local_rank, device="cpu",
                      backend="gloo", timeout_s=p.timeout_s, store=roles.role_store)  # None: env://
    ckpt = Checkpointer(run_dir / "ps-checkpoints", rank=roles.index, keep_last=cfg.checkpoint.keep_last,
                        mode="sync", meta={"config": cfg.to_dict(), "world_size": roles.world})

    def load(step: int | None, state: dict) -> int | None:
        """The shard saved at the workers' resume step, or (None: a restarted server) the latest."""
        found = [(s, path) for s, path in committed(ckpt.dir) if step is None or s == step]
        if found:
            ckpt.load(found[-1][1], state)
        return found[-1][0] if found else None

    try:
        source = (Hub(roles, mesh, p.timeout_s) if roles.links is not None else
                  AnySource(mesh.cross_role_group(roles.cross_store, roles.rank, roles.world, p.timeout_s), roles))
        return serve(cfg, roles, source, run_dir, save=ckpt.save, load=load)
    finally:
        ckpt.close()
        mesh.destroy()


def worker_main(cfg_dict: dict, job: Any) -> None:
    """Entry point of each worker (module level so that multiprocessing can pickle it)."""
    try:
        with reported_failures():
            run_training(Config.from_dict(cfg_dict), job)
    finally:
        # However the worker leaves (done, a clean stop, a failure), everything is closed by now:
        # skip the interpreter's final collection of torch's whole heap, which took 4-9 s of
        # every exit under load here (a stop before a time limit cannot spare it).
        gc.freeze()


@contextlib.contextmanager
def reported_failures():
    """In a launched worker: write torch's error file for any exception, so the launcher's
    summary names the cause; user-caused errors then exit without a traceback. A stop signal
    ends training cleanly at a step boundary (stopflag.py), with the exit code that says so."""
    _worker_setup()
    try:
        with FLAG.installed():
            yield
    except CleanStop as e:
        if worker_env().launched:  # the launcher says the one line for the whole job
            sys.exit(e.exit_code)
        _say_stopped(e)
        raise KeyboardInterrupt if e.signum == signal.SIGINT else SystemExit(e.exit_code)
    except AllhandsError as e:
        if worker_env().launched:
            _record_error(e)
            sys.exit(e.exit_code)
        raise
    except Exception as e:
        if worker_env().launched:
            _record_error(e)
        raise


def _say_stopped(e: CleanStop) -> None:
    """In-process (the Python API without a launcher): the one line of a clean stop."""
    where = (f"checkpoint {e.checkpoint} is committed" if e.checkpoint
             else "no checkpoint was committed yet")
    print(f"allhands: {e}; {where}; continue with allhands.train(..., resume={str(e.run_dir)!r})",
          file=sys.stderr, flush=True)


def _worker_setup() -> None:
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)


def _record_error(e: BaseException) -> None:
    ErrorHandler().record_exception(e)
