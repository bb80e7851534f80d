"""The typed config tree (tree.py) and its validation (validate.py, pipeline.py), under one name."""

from allhands.config.pipeline import PP_SCHEDULES, pp_microbatches, pp_stages_per_rank

from allhands.config.tree import (CheckpointConfig, Config, DataConfig, FaultConfig, LogConfig,
                                  ModelConfig, OptimConfig, ParallelConfig, PSConfig, RunConfig,
                                  SyncConfig,
                                  apply_override, load_config, to_toml)
from allhands.config.validate import (MESH_DIMS, SYNC_MODES, mesh_sizes, parse_mix,
                                      replica_group_config, replica_group_size, validate)
from allhands.errors import ConfigError

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "FaultConfig", "LogConfig",
           "MESH_DIMS", "ModelConfig", "OptimConfig", "PP_SCHEDULES", "PSConfig", "ParallelConfig",
           "RunConfig", "SYNC_MODES", "SyncConfig", "apply_override", "load_config", "mesh_sizes",
           "parse_mix",
           "pp_microbatches", "pp_stages_per_rank", "replica_group_config", "replica_group_size", "to_toml",
           "validate"]
