"""The parameter server's start-up in a worker process: the last ``ps.servers`` ranks serve
(server.py), the others train through the one loop with ``PSSync`` as their strategy. In replica
mode (``fault.mode = "replica"``) each worker is a world of its own, linked to the servers over the
MAC'd link store (links.py), and trains its share of every batch."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from allhands.checkpoint import Checkpointer, committed
from allhands.config import Config, validate
from allhands.env import WorkerEnv, ps_env, worker_env
from allhands.faults import FaultInjector
from allhands.heartbeat import Heartbeat
from allhands.lockstep import build_mesh, said_since
from allhands.mesh import Mesh
from allhands.paths import group_dir
from allhands.ps.client import PSSync
from allhands.ps.links import AnySource, Hub, Share
from allhands.ps.rows import detach_tables
from allhands.ps.server import serve
from allhands.ps.wire import Roles, ps_roles
from allhands.trainer import Job, Trainer


def run(cfg: Config, job: Job, env: WorkerEnv) -> dict[str, Any]:
    """This rank's role in a parameter-server job: a server, or a worker."""
    p = cfg.parallel
    if env.attempt and ps_env() is None:  # a restart of the whole job may bring fewer workers
        validate(cfg, world_size=env.world_size, need_data=False)
    roles = ps_roles(cfg.ps.servers, env.rank, env.world_size, p.timeout_s)
    if roles.server:
        return run_server(cfg, roles, env.local_rank)
    member = roles.links is not None  # replica mode: this worker is a world of its own
    mesh = (build_mesh(cfg, env) if member else
            build_mesh(cfg, env, rank=roles.index, world=roles.size, store=roles.role_store))
    try:
        t = time.time()
        run_dir = Path(cfg.run.dir)
        trainer = Trainer(cfg, ps_job(cfg, job), mesh, group_dir(run_dir, roles.index) if member else run_dir,
                          sync=lambda c, m, model: _strategy(c, m, roles))
        if member:  # its share of every batch; faults name the worker (ps/links.py)
            trainer.sampler = Share(trainer.sampler, roles.index, roles.n_workers)
            trainer.faults = trainer.strategy.faults = FaultInjector(cfg.fault.inject, roles.index, run_dir)
            trainer.strategy.heartbeat = trainer.heartbeat
        said_since(env.rank, "building the data, model and layout", t)
        result = trainer.fit()
        trainer.strategy.finish()  # after the last evaluation, which fetches embedding rows too
        return result
    finally:
        mesh.destroy()


def _strategy(cfg: Config, mesh: Mesh, roles: Roles) -> tuple[PSSync, str]:
    strategy = PSSync(cfg.ps, roles, total_steps=cfg.run.steps, timeout_s=cfg.parallel.timeout_s)
    return strategy, f"sync: {strategy.describe()}"


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


def run_server(cfg: Config, roles: Roles, local_rank: int) -> dict[str, Any]:
    """A parameter server (ps/server.py): its shard saved beside the workers' checkpoints."""
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
        # In replica mode the servers are a world of their own, whose watchdog finds a stopped
        # or hung server by its heartbeat (the workers waiting on it keep theirs fresh)
        beat = Heartbeat(worker_env().heartbeat_dir, roles.index) if roles.links is not None else None
        return serve(cfg, roles, source, run_dir, save=ckpt.save, load=load, heartbeat=beat)
    finally:
        ckpt.close()
        mesh.destroy()
