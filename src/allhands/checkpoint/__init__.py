"""Checkpoints: the Stateful contract (state.py), atomic sync/async saves and resume
(checkpointer.py), the per-rank DCP writer (writer.py), when to save (cadence.py), what is on disk
(catalog.py), reading without trusting (safe.py, manifest.py), and weights in and out (export.py)."""

from allhands.checkpoint.cadence import Cadence
from allhands.checkpoint.catalog import FORMAT_VERSION, META_NAME, check_compatible, committed
from allhands.checkpoint.checkpointer import Checkpointer
from allhands.checkpoint.export import checkpoint_weights, export_weights, load_weights
from allhands.checkpoint.state import ModelOptimState, RNGState, TrainState, seed_rank

__all__ = ["Cadence", "Checkpointer", "FORMAT_VERSION", "META_NAME", "ModelOptimState", "RNGState",
           "TrainState", "check_compatible", "checkpoint_weights", "committed", "export_weights",
           "load_weights", "seed_rank"]
