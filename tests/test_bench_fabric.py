"""bench/overhead.py's Lightning Fabric loop (the ``bench`` extra) runs here and does the same
work as the hand-written DDP loop it is compared with: on 2 gloo workers, from the same seed and
batches, both leave the same parameters after a few steps. Skipped without ``lightning``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from allhands.launch.launcher import LaunchSpec, launch
from allhands.launch.rundir import resolve_run

from conftest import ROOT, tiny_config

# Looked up, not imported: importing Lightning costs 3 s of CPU in every pytest process that
# collects this file, and only the workers below use it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="Lightning Fabric is not installed (the bench extra)")


def _both_loops(cfg_dict: dict, out: str) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from overhead import handwritten_steps, make_fabric

    from allhands.config import Config
    from allhands.data import load_token_splits
    from allhands.env import worker_env
    from allhands.mesh import Mesh

    cfg, env = Config.from_dict(cfg_dict), worker_env()
    mesh = Mesh.build(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                      device="cpu", backend="gloo", dp_replicate=-1, timeout_s=60)
    train_ds, _, _ = load_token_splits(cfg.data.path, cfg.model.seq_len)
    fabric = make_fabric(mesh.world_size)
    raw, fab = [], []
    steps = handwritten_steps(cfg, mesh, train_ds, 4, params=raw)
    fabric_steps = handwritten_steps(cfg, mesh, train_ds, 4, fabric, params=fab)
    diff = max(float((a - b).abs().max()) for a, b in zip(raw, fab))
    Path(out, f"rank{mesh.rank}.json").write_text(json.dumps({
        "fabric": type(fabric).__name__, "diff": diff, "n": [len(raw), len(fab)],
        "steps": [len(steps), len(fabric_steps)]}))
    mesh.destroy()


def test_fabric_loop_runs_and_matches_the_handwritten_loop(token_dir, tmp_path):
    cfg = resolve_run(tiny_config(token_dir, tmp_path / "run"), resume=None, world_size=2)
    out = tmp_path / "out"
    out.mkdir()
    launch(_both_loops, (cfg.to_dict(), str(out)), LaunchSpec(nproc=2), threads=1)
    for rank in (0, 1):
        r = json.loads((out / f"rank{rank}.json").read_text())
        assert r["fabric"] == "Fabric" and r["steps"] == [3, 3], r
        assert r["n"][0] == r["n"][1] > 0 and r["diff"] <= 1e-6, r
