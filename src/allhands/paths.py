"""Where the parts of a run live under its run directory, for the modes whose worlds write apart
(replica groups, a parameter server's worker worlds) and for what reads them back (the launcher,
the drill, resume)."""

from __future__ import annotations

from pathlib import Path


def group_dir(run_dir: Path, group: int) -> Path:
    """Where replica group (or ps worker world) ``group`` keeps its metrics and checkpoints: group
    0 the run directory itself (so reports and resume read it as in restart mode), the others beside it."""
    return run_dir if group == 0 else run_dir / "replicas" / f"group-{group}"
