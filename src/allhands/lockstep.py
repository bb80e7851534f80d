"""The common path of every worker process: the mesh of its world, its trainer, its fit. The
default mode (every rank in lock-step, restarted together on a failure) is this path alone; the
parameter server (ps/start.py) and replica groups (replica/start.py) take it with a world, a
strategy or loop hooks of their own."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from allhands.config import Config, validate
from allhands.env import WorkerEnv
from allhands.mesh import Mesh
from allhands.metrics import slow_phase
from allhands.trainer import Job, Trainer


def say(rank: int, line: str | None) -> None:
    if line and rank == 0:  # rank 0 speaks for the job, as its metrics writer does
        print(line, file=sys.stderr, flush=True)


def said_since(rank: int, what: str, t: float) -> float:
    """Say ``what`` took since ``t`` if slow (metrics.slow_phase); returns now."""
    now = time.time()
    say(rank, slow_phase(what, now - t))
    return now


def build_mesh(cfg: Config, env: WorkerEnv, *, rank: int | None = None, world: int | None = None,
               store: Any = None) -> Mesh:
    """This worker's mesh over its world: the launcher's (``env``), or one a mode cut out of it."""
    p, t = cfg.parallel, time.time()
    mesh = Mesh.build(rank=env.rank if rank is None else rank,
                      world_size=env.world_size if world is None else world, local_rank=env.local_rank,
                      device=cfg.run.device, backend=p.backend, dp_replicate=p.dp_replicate,
                      dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, timeout_s=p.timeout_s,
                      store=store)
    said_since(env.rank, "the workers' rendezvous (process groups)", t)
    return mesh


def run(cfg: Config, job: Job, env: WorkerEnv) -> dict[str, Any]:
    """Lock-step training of the whole job in this worker."""
    if env.attempt:  # an elastic restart may bring fewer workers: the batch must still divide
        validate(cfg, world_size=env.world_size, need_data=False)
    mesh = build_mesh(cfg, env)
    try:
        t = time.time()
        trainer = Trainer(cfg, job, mesh, Path(cfg.run.dir))
        said_since(env.rank, "building the data, model and layout", t)
        return trainer.fit()
    finally:
        mesh.destroy()
