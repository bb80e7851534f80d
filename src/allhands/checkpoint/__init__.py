"""Checkpoints: the Stateful contract (state.py), atomic sync/async saves and resume
(checkpointer.py), the per-rank DCP writer (writer.py), when to save (cadence.py), what is on disk
(catalog.py), reading without trusting (safe.py, manifest.py), and weights in and out (export.py)."""

import importlib

# Names resolved on first use (PEP 562), for start-up time: the launcher needs only the catalog
# (which checkpoints are committed), not torch's Distributed Checkpoint behind the Checkpointer.
_WHERE = {"Cadence": "cadence", "FORMAT_VERSION": "catalog", "META_NAME": "catalog",
          "check_compatible": "catalog", "committed": "catalog", "Checkpointer": "checkpointer",
          "checkpoint_weights": "export", "export_weights": "export", "load_weights": "export",
          "sharded_loader": "export",
          "ModelOptimState": "state", "RNGState": "state", "SchedulerState": "state", "TrainState": "state",
          "seed_rank": "state"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
