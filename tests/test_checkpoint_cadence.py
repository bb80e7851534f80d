"""``checkpoint.max_overhead`` end to end: a real 2-rank job measures what a save costs and how
long a step takes, picks the save interval with CheckFreq's rule, and then saves exactly there.

The unit test in test_checkpoint_async.py checks the rule on made-up timings; this one checks the
wiring: the inputs the trainer records are the run's own measurements (its logged step times),
the interval follows from them by the rule, and the committed checkpoints sit at that cadence."""

from __future__ import annotations

import json
import math

from allhands.checkpoint import committed
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.checkpoint.manifest import verify_manifest

from conftest import tiny_config

BASE, BOUND, STEPS = 2, 0.5, 40


def test_max_overhead_measures_the_save_cost_and_saves_at_the_picked_interval(token_dir, tmp_path):
    run_dir = tmp_path / "run"
    # keep_last high: every save stays on disk, so the committed steps are the cadence itself.
    cfg = tiny_config(token_dir, run_dir, f"run.steps={STEPS}", f"checkpoint.interval={BASE}",
                      f"checkpoint.max_overhead={BOUND}", "checkpoint.keep_last=1000",
                      "checkpoint.mode=async", "log.interval=1")
    train_job(cfg, LaunchSpec(nproc=2))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in rows if r.get("checkpoint_saved")]
    steps = [r for r in rows if "step_time" in r]
    saved_at = [r["step"] for r in saves]

    # Every save the trainer records is a committed, verified checkpoint, and nothing else is.
    on_disk = committed(run_dir / "checkpoints")
    assert [s for s, _ in on_disk] == saved_at
    for _, path in on_disk:
        verify_manifest(path)

    # Nothing is measured before the first save; the second one is still at the base interval.
    assert saved_at[:2] == [BASE, 2 * BASE]
    assert "checkpoint_cost_s" not in saves[0]
    picked = [r for r in saves if "checkpoint_cost_s" in r]
    assert picked, saves
    for r in picked:
        cost, t = r["checkpoint_cost_s"], r["checkpoint_step_time_s"]
        # The rule, from the recorded inputs: the smallest multiple of the base interval whose
        # overhead cost / (k * t) stays under the bound.
        assert r["checkpoint_interval"] == BASE * max(1, math.ceil(cost / (BOUND * t * BASE))), r
        assert cost / (r["checkpoint_interval"] * t) <= BOUND
        assert cost > 0, r
        # The step time is the run's own: the rule takes, per rank, the median of its steps
        # without a save in flight (a subset of the steps logged so far: log.interval=1, the same
        # per-step time) and then the slowest rank's, so it lies within these logged bounds.
        per_rank = list(zip(*(s["step_time_rank"] for s in steps if s["step"] <= r["step"])))
        lo, hi = max(min(ts) for ts in per_rank), max(max(ts) for ts in per_rank)
        assert lo <= t <= hi, (t, lo, hi)
    # The cost of an async save (state dicts, planning, write, fsync, manifest, commit) is many
    # tiny steps here, so the rule must have stretched the interval at least once...
    assert max(r["checkpoint_interval"] for r in saves) > BASE, saves
    # ...and each next save happened exactly where the previous one said (the last save of the
    # run may come early: checkpoint.at_end saves the final step).
    for prev, nxt in zip(saves, saves[1:]):
        gap = nxt["step"] - prev["step"]
        assert gap == prev["checkpoint_interval"] or (nxt["step"] == STEPS and gap < prev["checkpoint_interval"]), \
            (prev, nxt)
    assert saved_at[-1] == STEPS
