"""The typed config tree (tree.py), its layers (layering.py: defaults < TOML < --set) and its
validation (validate.py and the per-section checks it calls), under one name."""

from allhands.config.tree import (CheckpointConfig, Config, DataConfig, FaultConfig, LogConfig,
                                  ModelConfig, OptimConfig, ParallelConfig, PSConfig, RunConfig,
                                  SyncConfig, given, mark_given)
from allhands.config.layering import apply_override, load_config, to_toml
from allhands.config.moe import MoEConfig
from allhands.config.layout_checks import MESH_DIMS, mesh_sizes
from allhands.config.pipeline import PP_SCHEDULES, pp_microbatches, pp_stages_per_rank
from allhands.config.mode_checks import SYNC_MODES, replica_group_config, replica_group_size
from allhands.config.validate import parse_mix, validate
from allhands.errors import ConfigError

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "FaultConfig", "LogConfig",
           "MESH_DIMS", "ModelConfig", "MoEConfig", "OptimConfig", "PP_SCHEDULES", "PSConfig", "ParallelConfig",
           "RunConfig", "SYNC_MODES", "SyncConfig", "apply_override", "given", "load_config", "mark_given", "mesh_sizes",
           "parse_mix",
           "pp_microbatches", "pp_stages_per_rank", "replica_group_config", "replica_group_size", "to_toml",
           "validate"]
