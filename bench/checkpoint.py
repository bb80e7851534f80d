"""Training stall per checkpoint, asynchronous vs synchronous, and the steady overhead of
checkpointing every N steps.

Two gloo ranks train the reference GPT with DDP + AdamW (the allhands state: model, optimizer,
step, RNG) and save through allhands' Checkpointer. Each round runs, in the same processes, for
every N in ``--intervals`` a series of ``--blocks`` x N steps with no save (``base@N``) and one
with an async save after each block (``async@N``; the series ends when its last write is
committed), plus, at the first N only, sync saves (``sync@N``, for the stall ratio, which does not
depend on N) and with ``--nice0`` the writer thread at nice 0 instead of allhands'
``WRITER_NICE`` (``async0@N``). The order rotates from round to round, so machine noise and
warm-up hit all alike; figures are medians over the rounds, overheads the median of per-round
paired ratios (wall time, and CPU time of both ranks' processes, all threads, which other jobs on
the machine inflate far less). One save per mode before the rounds prepares the directories, the
host buffers and DCP's plan cache. Figures:

- stall: wall time the training thread is blocked by a save: inside ``Checkpointer.save`` (sync:
  the whole DCP write, manifest, fsync and rename; async: taking the state dicts, plus any wait
  for the previous save, which the one-in-flight rule imposes) plus, async, the wait in the next
  step's ``before_update`` for the rest of the copy to host memory, as in the trainer: every
  series ends with one more step after its last save, so the copy overlaps that step's
  forward/backward (before 2026-12-03 the bench waited for the copy right after the save, which
  the trainer never does, and charged the whole copy to the stall). Target: sync / async >= 50.
- overhead: (series time with async saves - baseline series time) / baseline series time, for a
  save every N steps. Target <= 1% at N = 20. Also printed: the cost of one save that this implies (CPU
  seconds and wall seconds) and the interval ``checkpoint.max_overhead=0.02`` would pick from it.
  Series of the same work vary by several percent between rounds on this shared machine (up to
  +-10%), as much as the effect, so:
- cost per save from ``--triples`` adjacent blocks of ``--triple-steps`` steps, X (no save), Y
  (ends with an async save), Z (its write runs in the background; a write still running at Z's end
  is waited for inside Z), then the next X: cost = Y + Z - X_before - X_after, whose neighbours
  share the slow noise. Printed as mean +- 2 standard errors, with the overhead it implies at
  each N (cost / (N x step)); valid while a save's write ends within N steps, as here.

    python bench/checkpoint.py [--rounds 4] [--intervals 20,50,100] [--blocks 1] [--nice0]
                               [--triples 30] [--triple-steps 10] [--set KEY=VALUE ...]
                               [--sizes 38,165,292]   (one run per state size, then a table)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import MODEL, CheckpointBenchJob  # noqa: E402  (bench/ is sys.path[0])

# --sizes: the model + AdamW states of the checkpoint figures (MiB on disk), each with a global
# batch that keeps its step near the 38 MiB one's.
SIZES = {"38": [], "165": ["model.n_layer=8", "model.n_embd=384", "model.n_head=6", "run.global_batch=4"],
         "292": ["model.n_layer=8", "model.n_embd=512", "model.n_head=8", "run.global_batch=2"]}


def worker(cfg_dict: dict, rounds: int, intervals: list[int], blocks: int, nice0: bool, triples: int,
           triple: int, out: str) -> None:
    import json

    import allhands.checkpoint.writer as ckpt_mod  # WRITER_NICE: read by each save's writer
    from allhands.checkpoint import Checkpointer

    job = CheckpointBenchJob(cfg_dict)
    mesh, ts, state = job.mesh, job.ts, job.state

    waited = [0.0]  # seconds in before_update: the part of an async save's copy not overlapped

    def steps(n: int, ckpt: Checkpointer | None = None) -> None:
        for _ in range(n):
            job.backward()
            if ckpt is not None:  # as the trainer does: the copy to host memory ends here at the latest
                w0 = time.perf_counter()
                ckpt.before_update()
                waited[0] += time.perf_counter() - w0
            job.update()

    nice = {"async": ckpt_mod.WRITER_NICE, "async0": 0}
    modes = ("sync", "async", "async0") if nice0 else ("sync", "async")
    ckpts = {m: Checkpointer(Path(out) / m, rank=mesh.rank, keep_last=1, mode=m[:5],
                             group=mesh.checkpoint_group() if m != "sync" else None)
             for m in modes}
    steps(3)  # warm-up: optimizer state exists, so every save has the same size
    for c in ckpts.values():  # each Checkpointer's first save also prepares the directory
        c.save(ts.step, state)
        c.wait()
    # Series "<mode>@<N>": base and async at every interval; sync (and async0) at the first only,
    # for the stall ratio, which does not depend on N.
    order = [f"{m}@{n}" for n in intervals for m in ("base", "async")]
    order += [f"{m}@{intervals[0]}" for m in modes if m != "async"]
    res: dict[str, list[float]] = {k: [] for s in order for k in (s, f"stall_{s}", f"cpu_{s}", f"copywait_{s}")}
    for r in range(rounds):
        k = r % len(order)
        for series in order[k:] + order[:k]:
            mode, interval = series.split("@")[0], int(series.split("@")[1])
            ckpt = ckpts.get(mode)
            ckpt_mod.WRITER_NICE = nice.get(mode, ckpt_mod.WRITER_NICE)  # read by each save's writer
            t0, c0 = time.perf_counter(), time.process_time()  # process CPU: every thread's
            for b in range(blocks):
                w0 = waited[0]
                steps(interval, ckpt)
                if ckpt is not None:
                    if b:  # what of the previous save's copy did not overlap these steps
                        res[f"stall_{series}"][-1] += waited[0] - w0
                        res[f"copywait_{series}"][-1] += waited[0] - w0
                    s0 = time.perf_counter()
                    ckpt.save(ts.step, state)
                    res[f"stall_{series}"].append(time.perf_counter() - s0)
                    res[f"copywait_{series}"].append(0.0)
            # Every series (base too) ends with one more step: the trainer's next step, whose
            # forward/backward the last save's copy overlaps; what of the copy is left waits in
            # its before_update and belongs to that save's stall.
            w0 = waited[0]
            steps(1, ckpt)
            if ckpt is not None:
                res[f"stall_{series}"][-1] += waited[0] - w0
                res[f"copywait_{series}"][-1] += waited[0] - w0
                ckpt.wait()  # and the rest of its write to this series' time
            res[series].append(time.perf_counter() - t0)
            res[f"cpu_{series}"].append(time.process_time() - c0)
    # The cost of one async save from adjacent blocks of ``triple`` steps: X (clean), Y (ends
    # with a save), Z (its write runs in the background), then the next X. Slow machine noise
    # (series of the same work vary by several percent here) is shared by neighbouring blocks of ~2 s, so
    # cost = (Y + Z) - (X_before + X_after) cancels it, and a linear drift too; a write still
    # running at the end of Z is waited for inside Z (counted in ``late``).
    ckpt = ckpts["async"]
    ckpt_mod.WRITER_NICE = nice["async"]

    def block(save: bool, drain: bool) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        steps(triple, ckpt)
        if save:
            ckpt.save(ts.step, state)
        if drain and ckpt.in_flight:
            res["late"][0] += 1
            ckpt.wait()
        return time.perf_counter() - t0, time.process_time() - c0

    res["late"] = [0.0]
    for key in ("X", "Y", "Z"):
        res[key], res[f"cpu_{key}"] = [], []
    if triples:  # the X before the first triple
        wall, cpu = block(False, False)
        res["X"].append(wall)
        res["cpu_X"].append(cpu)
    for _ in range(triples):
        for key, save, drain in (("Y", True, False), ("Z", False, True), ("X", False, False)):
            wall, cpu = block(save, drain)
            res[key].append(wall)
            res[f"cpu_{key}"].append(cpu)
    for c in ckpts.values():
        c.close()
        assert c.failures == 0, c.warnings
    if mesh.rank == 0:
        size = sum(p.stat().st_size for p in next(iter((Path(out) / "async").glob("step-*"))).rglob("*")
                   if p.name != "manifest.json")
        res["bytes"] = [float(size)]
    Path(out, f"result-{mesh.rank}.json").write_text(json.dumps(res))
    mesh.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--intervals", default="20,50,100", help="save every N steps, comma-separated")
    ap.add_argument("--blocks", type=int, default=1, help="saves per series")
    ap.add_argument("--nice0", action="store_true", help="also run the writer at nice 0 (async0)")
    ap.add_argument("--triples", type=int, default=30, help="X/Y/Z block triples for the per-save cost")
    ap.add_argument("--triple-steps", type=int, default=10, help="steps per X/Y/Z block")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides after the bench's own, e.g. a larger model for the stall at a larger state")
    ap.add_argument("--interval", type=int, help="one N: the same as --intervals N (older runs' command)")
    ap.add_argument("--sizes", default="", help="comma-separated state sizes from SIZES (38,165,292): one run "
                    "per size, then their figures side by side; --set applies to every size")
    args = ap.parse_args()
    intervals = [args.interval] if args.interval else [int(n) for n in args.intervals.split(",")]
    sizes = [s for s in args.sizes.split(",") if s]
    if not sizes:
        run(args, intervals, args.set)
        return
    rows = [(s, run(args, intervals, [*SIZES[s], *args.set])) for s in sizes]
    print(f"\nside by side (2 ranks, DDP + AdamW; async stall = time in save() + the wait in the next "
          f"before_update; overhead: a save every {intervals[0]} steps)")
    print("| state on disk | sync stall | async stall | sync / async | overhead, series | overhead, triples |")
    print("| --- | --- | --- | --- | --- | --- |")
    for _, f in rows:
        print(f"| {f['mib']:.1f} MiB | {f['sync']:.3f} s | {1000 * f['async']:.2f} ms | {f['sync'] / f['async']:.0f}x "
              f"| {100 * f['over']:+.2f}% | " + (f"{100 * f['triple']:+.2f}% +- {100 * f['triple_2se']:.2f}" if
                                                 'triple' in f else "-") + " |")


def run(args, intervals: list[int], sets: list[str]) -> dict:
    """One size: its launch and its printed figures; returns the summary figures."""
    import json

    from allhands.checkpoint.writer import WRITER_NICE
    from allhands.config import load_config
    from allhands.launch.launcher import LaunchSpec, launch
    from allhands.launch.rundir import resolve_run

    out = tempfile.mkdtemp(prefix="allhands-bench-ckpt-")
    job = [*MODEL, "run.global_batch=16", *sets]  # later overrides win
    cfg = load_config(overrides=[*job, f"run.dir={out}/resolve",
                                 "log.progress=false", "log.tensorboard=false"])
    cfg = resolve_run(cfg, resume=None, world_size=2)
    load0 = os.getloadavg()[0]
    launch(worker, (cfg.to_dict(), args.rounds, intervals, args.blocks, args.nice0, args.triples,
                    args.triple_steps, out), LaunchSpec(nproc=2))
    r = json.loads(Path(out, "result-0.json").read_text())
    r1 = json.loads(Path(out, "result-1.json").read_text())
    n0 = intervals[0]
    modes = ["sync", "async", "async0"] if args.nice0 else ["sync", "async"]
    cpu = {k[4:]: [a + b for a, b in zip(r[k], r1[k])] for k in r if k.startswith("cpu_")}
    med = {k: statistics.median(v) for k, v in r.items() if v}
    stall_async = statistics.median(v for n in intervals for v in r[f"stall_async@{n}"])
    print(f"rounds={args.rounds} intervals={args.intervals} blocks={args.blocks} ranks=2 job={' '.join(job)} "
          f"checkpoint={r['bytes'][0] / 2**20:.1f} MiB on disk; writer at nice {WRITER_NICE}"
          f"{' (async0: nice 0)' if args.nice0 else ''}; load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    print("stall per save (s): sync " + " ".join(f"{v:.4f}" for v in r[f"stall_sync@{n0}"]))
    for m in modes[1:]:
        for n in (intervals if m == "async" else [n0]):
            print(f"stall per save (s): {m}@{n} " + " ".join(f"{v:.4f}" for v in r[f"stall_{m}@{n}"]))
    waits = [v for n in intervals for v in r[f"copywait_async@{n}"]]
    print(f"of the async stall, waiting in the next before_update for the copy: median {statistics.median(waits):.4f} s, "
          f"max {max(waits):.4f} s (the rest is inside Checkpointer.save)")
    print(f"median stall per save: sync {med[f'stall_sync@{n0}']:.3f} s, async {stall_async:.4f} s (all "
          f"intervals); ratio sync/async = {med[f'stall_sync@{n0}'] / stall_async:.1f}x (target >= 50)")
    # Paired per round: a round's series ran back to back, so drift cancels within it.
    costs, cpu_costs = [], []
    for n in intervals:
        base, base_cpu = r[f"base@{n}"], cpu[f"base@{n}"]
        step = statistics.median(base) / (n * args.blocks + 1)
        lines = []
        for m in (modes if n == n0 else ["async"]):
            over = statistics.median((x - b) / b for x, b in zip(r[f"{m}@{n}"], base))
            cover = statistics.median((x - b) / b for x, b in zip(cpu[f"{m}@{n}"], base_cpu))
            lines.append(f"{m} {100 * over:+.1f}% wall, {100 * cover:+.1f}% CPU")
            if m == "async":
                costs.append(over * n * step)
                cpu_costs.append(statistics.median(x - b for x, b in zip(cpu[f"async@{n}"], base_cpu)) / args.blocks)
        print(f"save every {n} steps (step {step:.3f} s, {args.blocks} x {n} steps per series): "
              + "; ".join(lines) + (" (target <= 1%)" if n == n0 else ""))
    print("series (s): " + " | ".join(f"{k} " + " ".join(f"{v:.2f}" for v in r[k]) for k in r
                                      if "@" in k and not k.startswith(("stall_", "cpu_", "copywait_"))))
    print("CPU per series, both ranks (s): " + " | ".join(f"{k} " + " ".join(f"{v:.2f}" for v in cpu[k]) for k in cpu))
    step = statistics.median(r[f"base@{n0}"]) / (n0 * args.blocks + 1)
    cost = statistics.median(costs)
    pick = max(1, math.ceil(cost / (0.02 * step))) if cost > 0 else 1
    print(f"one async save: {statistics.median(cpu_costs):.3f} CPU s (both ranks; per interval "
          + " ".join(f"{c:.3f}" for c in cpu_costs) + f"), adds {cost:.3f} s wall = {cost / step:.2f} steps "
          f"(per interval " + " ".join(f"{c:.3f}" for c in costs) + f" s); checkpoint.max_overhead=0.02 "
          f"with checkpoint.interval=1 would save every {pick} steps")
    summary = {"mib": r["bytes"][0] / 2**20, "sync": med[f"stall_sync@{n0}"], "async": stall_async,
               "over": statistics.median((x - b) / b for x, b in zip(r[f"async@{n0}"], r[f"base@{n0}"]))}
    if args.triples > 1:
        summary["triple"], summary["triple_2se"] = triple_costs(r, r1, args.triple_steps, intervals)
    return summary


def triple_costs(r: dict, r1: dict, triple: int, intervals: list[int]) -> tuple[float, float]:
    """Print the per-save cost from the X/Y/Z triples and the overhead it implies at each N;
    return that overhead at the first N and its 2 standard errors."""
    """Print the per-save cost from the X/Y/Z triples and the overhead it implies at each N."""
    x, y, z = r["X"], r["Y"], r["Z"]
    wall = [b + c - a - d for a, b, c, d in zip(x, y, z, x[1:])]
    both = {k: [a + b for a, b in zip(r[f"cpu_{k}"], r1[f"cpu_{k}"])] for k in "XYZ"}
    cpu = [b + c - a - d for a, b, c, d in zip(both["X"], both["Y"], both["Z"], both["X"][1:])]
    step = statistics.median(x) / triple
    k = len(wall)

    def mean_2se(v: list[float]) -> tuple[float, float]:
        return statistics.fmean(v), 2 * statistics.stdev(v) / math.sqrt(len(v))

    m, e = mean_2se(wall)
    cm, ce = mean_2se(cpu)
    print(f"one async save from {k} X/Y/Z triples of {triple} steps (step {step:.3f} s): wall {m:+.3f} s "
          f"+- {e:.3f} (2 standard errors; median {statistics.median(wall):+.3f}) = {m / step:.2f} steps; "
          f"CPU of both ranks {cm:+.3f} s +- {ce:.3f}; writes still running at the end of Z: {int(r['late'][0])}")
    print("  clean blocks X (s): " + " ".join(f"{v:.2f}" for v in x))
    print("  cost per triple (s): " + " ".join(f"{v:+.3f}" for v in wall))
    for n in intervals:
        print(f"  implied overhead of a save every {n} steps: {100 * m / (n * step):+.2f}% "
              f"({100 * (m - e) / (n * step):+.2f}% .. {100 * (m + e) / (n * step):+.2f}%) (target <= 1%)")
    return m / (intervals[0] * step), e / (intervals[0] * step)


if __name__ == "__main__":
    main()
