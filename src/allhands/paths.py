"""Where the parts of a run live under its run directory, for the modes whose worlds write apart
(replica groups, a parameter server's worker worlds) and for what reads them back (the launcher,
the drill, resume)."""

from __future__ import annotations

from pathlib import Path


def group_dir(run_dir: Path, group: int) -> Path:
    """Where replica group (or ps worker world) ``group`` keeps its metrics and checkpoints: group
    0 the run directory itself (so reports and resume read it as in restart mode), the others beside it."""
    return run_dir if group == 0 else run_dir / "replicas" / f"group-{group}"


def restart_logs(run_dir: Path) -> dict[str, Path]:
    """Every world's ``restarts.jsonl`` in a run, by world: ``job`` (restart mode, or replica
    group 0), ``group-N`` (replica groups), ``ps-servers`` and ``ps-worker-N`` (a parameter
    server in replica mode, launch/psgroups.py), each world's supervisor writing its own."""
    found = {"job": run_dir / "logs" / "restarts.jsonl",
             "ps-servers": run_dir / "ps-servers" / "logs" / "restarts.jsonl",
             "ps-worker-0": run_dir / "ps-worker" / "logs" / "restarts.jsonl"}
    for g in sorted((run_dir / "replicas").glob("group-*"), key=lambda p: int(p.name[6:])):
        found[g.name] = g / "logs" / "restarts.jsonl"
        found[f"ps-worker-{g.name[6:]}"] = g / "ps-worker" / "logs" / "restarts.jsonl"
    return {w: p for w, p in found.items() if p.exists()}
