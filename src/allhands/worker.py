"""Inside a worker process: environment -> mesh -> Trainer, and the worker's failures
recorded for the launcher's one-line summary."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from allhands.config import Config, validate
from allhands.env import worker_env
from allhands.errors import AllhandsError
from allhands.mesh import Mesh
from allhands.trainer import Job, Trainer


def run_training(cfg: Config, job: Any = None) -> dict[str, Any]:
    """Train in this process as one worker of the job the environment describes."""
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


def worker_main(cfg_dict: dict, job: Any) -> None:
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
    ErrorHandler().record_exception(e)
