"""Chaos soak: many seeded faults of every kind each mode takes, through ``allhands drill --chaos``,
one long run per mode, side by side with the same job undisturbed.

Per mode (restart: DDP on 2 ranks; replica: 2 groups; ps: 2 workers and a server, each a world of
its own), ``--faults`` faults drawn from the seed (chaos/run.py: worker and server SIGKILL,
SIGSTOP past the hang timeout, a kill inside a checkpoint write, a SIGKILL of the launcher, the
newest checkpoint torn, a second kill during a recovery), then the invariant checker. Figures:

- faults fired / survived (the checker's ``faults`` rule: recorded, detected, a step after);
- commits lost: times the newest committed step went backwards (but for a torn one), target 0;
- orphans: processes, /dev/shm entries and temporary files left (target 0);
- recovery per fault kind (fault to the first completed step after its restart), median / max;
- goodput: run.steps x the undisturbed median step time (a 30-step probe of the same job) / the
  faulted run's wall time from its first step to its last, restart mode beside the others;
  run.steps is what the undisturbed job takes the chaos duration (10 s a fault) for.

Every run's seed is printed: ``allhands drill --chaos D --seed S`` with the printed sets replays it.

    python bench/chaos.py [--faults 17] [--modes restart,replica,ps] [--seed 11]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODEL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.seq_len=32", "run.global_batch=8",
         "run.eval_interval=0", "data.eval_batches=0", "log.progress=false", "log.tensorboard=false"]
COMMON = ["checkpoint.interval=2", "fault.hang_timeout_s=3", "fault.backoff_s=0.1"]
MODES = {"restart": (2, []),
         "replica": (2, ["fault.mode=replica", "fault.quorum_timeout_s=0.5"]),
         "ps": (3, ["parallel.sync=ps", "ps.mode=async", "fault.mode=replica"])}


def _undisturbed(nproc: int, sets: list[str], run_dir: Path) -> float:
    """The median step time of the same job with no faults."""
    subprocess.run([sys.executable, "-m", "allhands.cli", "train", "--nproc", str(nproc),
                    *[f"--set={s}" for s in sets], f"--set=run.dir={run_dir}", "--set=log.interval=1"],
                   check=True, capture_output=True, text=True, cwd=ROOT)
    from allhands.chaos.check import read_run

    ts = read_run(run_dir, 1)["step_times"]["job"]
    return statistics.median(b - a for a, b in zip(ts, ts[1:]))


def soak(mode: str, faults: int, seed: int, out: Path) -> dict:
    from allhands.chaos import check as chk
    from allhands.chaos.run import run_chaos
    from allhands.config import load_config, validate
    from allhands.launch.launcher import LaunchSpec
    from allhands.launch.rundir import with_data

    nproc, extra = MODES[mode]
    # as many steps as the undisturbed job takes the chaos duration for (one fault per 10 s of
    # it), at least 6 a fault
    probe = [*MODEL, *COMMON, *extra, "run.steps=30"]
    step_s = _undisturbed(nproc, probe, out / f"{mode}-probe")
    steps = max(6 * faults + 4, round(10.0 * faults / step_s))
    sets = [*MODEL, *COMMON, *extra, f"run.steps={steps}"]
    cfg = with_data(load_config(None, [*sets, f"run.dir={out / mode}"]))
    validate(cfg)
    report: dict = {}
    with open(out / f"{mode}.log", "w") as log:
        ok = run_chaos(cfg, LaunchSpec(nproc=nproc), config_path=None, sets=[*sets, f"run.dir={out / mode}"],
                       duration_s=10.0 * faults, seed=seed, out=log, report=report)
    rec, rows = report["record"], {r.rule: r for r in report["rows"]}
    lost = len(chk.commits_back(rec))
    by_kind: dict[str, list[float]] = {}
    recovered = chk.recoveries(rec)
    for f, _, back in recovered:
        if back is not None:
            by_kind.setdefault(f.kind, []).append(back)
    ts = rec.step_times.get("job", [])
    wall = ts[-1] - ts[0] if len(ts) > 1 else float("nan")
    left = rows["leftovers"].detail
    return {"mode": mode, "seed": seed, "faults": len(rec.fired), "ok": ok,
            "survived": len(rec.fired) - sum(b is None for _, _, b in recovered),
            "lost": lost, "orphans": 0 if left == "none" else left, "rules": {k: r.ok for k, r in rows.items()},
            "recovery": {k: (statistics.median(v), max(v), len(v)) for k, v in sorted(by_kind.items())},
            "goodput": steps * step_s / wall, "steps": steps, "sets": sets,
            "duration": 10.0 * faults, "plan": [str(p) for p in report["plan"]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faults", type=int, default=17, help="faults per mode")
    ap.add_argument("--modes", default="restart,replica,ps")
    ap.add_argument("--seed", type=int, default=11, help="mode i uses seed + i")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="allhands-bench-chaos-"))
    results = []
    for i, mode in enumerate(args.modes.split(",")):
        t0 = time.time()
        r = soak(mode, args.faults, args.seed + i, out)
        results.append(r)
        print(f"{mode}: seed {r['seed']}, {r['faults']} faults, {r['survived']} survived, commits lost "
              f"{r['lost']}, orphans {r['orphans']}, goodput {r['goodput']:.2f}, every rule "
              f"{'kept' if r['ok'] else 'NOT kept: ' + str(r['rules'])} ({time.time() - t0:.0f} s)", flush=True)
        for kind, (med, worst, n) in r["recovery"].items():
            print(f"  recovery {kind:<9} median {med:5.1f} s  max {worst:5.1f} s  ({n})")
        print(f"  replay: allhands drill --nproc {MODES[mode][0]} --chaos {r['duration']:g} --seed {r['seed']} "
              + " ".join(f"--set {s}" for s in r["sets"]), flush=True)
    total = sum(r["faults"] for r in results)
    print(f"all modes: {total} faults, {sum(r['survived'] for r in results)} survived, commits lost "
          f"{sum(r['lost'] for r in results)}, runs in {out}")


if __name__ == "__main__":
    main()
