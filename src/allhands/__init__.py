"""allhands: one model, trained by many processes and machines at once, on torch.distributed.

Python API::

    import allhands
    cfg = allhands.load_config("job.toml", ["optim.lr=1e-3"])
    allhands.train(cfg, model=build_model, data=build_dataset, loss=loss_fn)

Run a script that calls ``train`` under ``allhands launch --nproc N script.py`` for N workers;
called without a launcher it trains in this process as a single worker.
"""

from allhands.config import Config, load_config, validate
from allhands.errors import AllhandsError, CheckpointError, ConfigError, DataError, LaunchError

__version__ = "0.1.0"


def train(config: Config | None = None, *, model=None, data=None, loss=None, resume: str | None = None,
          tp_plan=None):
    """Train ``model(config)`` on ``data(config)`` with ``loss(output, target)``; returns the last
    step's metrics on every rank.

    ``model``: a plain single-device ``nn.Module``, or a function ``(config) -> nn.Module``
    (default: the reference GPT).
    ``data``: a map-style dataset of ``(input, target)`` items or a torch ``IterableDataset``
    (read in order, each rank keeping its share: data/iterable.py), or ``(train, val)`` of
    those, or a function ``(config) -> any of these`` (default: token shards at
    ``config.data.path``, or the embedded corpus).
    ``loss``: ``(output, target) -> scalar`` (default: next-token cross entropy).
    A mistake in these (no trainable parameters, a loss that is not a scalar, fewer samples
    than one global batch) raises ConfigError before the first step.
    ``tp_plan``: under ``parallel.tp > 1``, ``{module FQN: DTensor ParallelStyle}`` or a callable
    ``(model, sequence_parallel) -> that`` (default: the model's own ``tp_plan`` method).
    """
    # Here, not at the top: `import allhands` for its config and errors does not import torch.
    from pathlib import Path

    from allhands.env import worker_env
    from allhands.job import Job
    from allhands.jobcheck import data_builder, loss_function, model_builder
    from allhands.launch.rundir import removed_if_unstarted, resolve_run
    from allhands.worker import reported_failures, run_training

    with reported_failures():
        cfg = config if config is not None else Config()
        job = Job(model=model_builder(model), data=data_builder(data), loss=loss_function(loss),
                  tp_plan=tp_plan)
        env = worker_env()
        if env.world_size > 1 and not (cfg.run.dir or resume):
            raise ConfigError("run.dir: set it when training under a launcher, so that every worker "
                              "writes to the same run directory")
        if env.attempt and cfg.run.dir and not resume:  # restarted by the supervisor: continue
            resume = cfg.run.dir
        # in this process only: a launched rank 0 cannot know whether its peers have started
        fresh = not (env.launched or resume or (cfg.run.dir and Path(cfg.run.dir).exists()))
        cfg = resolve_run(cfg, resume=resume, world_size=env.world_size, write=env.rank == 0,
                          own_data=job.data is not None)
        with removed_if_unstarted(Path(cfg.run.dir), created=fresh):
            return run_training(cfg, job)


__all__ = ["AllhandsError", "CheckpointError", "Config", "ConfigError", "DataError", "LaunchError",
           "__version__", "load_config", "train", "validate"]
