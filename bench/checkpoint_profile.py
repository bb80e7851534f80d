"""Where an async save's CPU goes, per thread, in the real 2-rank setting of bench/checkpoint.py.

Two gloo ranks train the same GPT (DDP + AdamW, the same 38 MiB state) and run, alternately, a
series of ``--saves`` x ``--interval`` steps with no save and one with an async save after each
block. Per series and rank it records the CPU time of every thread that lives through the series
(``/proc/self/task/<tid>/schedstat``, nanoseconds: the training thread, the stager's thread,
gloo's worker threads), the whole process's CPU (``time.process_time``), and, by wrapping the
pieces with ``time.thread_time``, what each part of a save costs in the thread it runs in:

- training thread: ``Checkpointer.save`` (taking the state dicts, handing them over) and ``before_update`` (waiting for the copy to host memory);
- stager thread: ``DefaultStager._stage`` (the copy of model + optimizer to host memory);
- write thread (one for the run, allhands.checkpoint.saver): the whole ``dcp.save`` it runs, split into planning (DCP's
  ``reduce_scatter``: local plan, gather, global plan, scatter), ``write_data`` (serialise +
  write + fsync of this rank's file), and the rest of the final ``all_reduce`` (gather results,
  ``.metadata``); rank 0's commit (``allhands.json``, manifest SHA-256, rename, keep_last).

Threads that ended during a series show as the process's CPU minus the CPU of the threads
still alive ("gone threads"; 0 since the write thread lives for the run). ``--cprofile`` also
profiles the write thread's ``dcp.save`` and prints its top functions per rank (wall time inside
each call, GIL waits included).

    python bench/checkpoint_profile.py [--rounds 3] [--saves 3] [--interval 20] [--cprofile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import MODEL, CheckpointBenchJob  # noqa: E402  (the same model and state as bench/checkpoint.py)


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of every live thread of this process, by native id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError):
            pass
    return out


def worker(cfg_dict: dict, rounds: int, saves: int, interval: int, cprofile: bool, out: str) -> None:
    import cProfile
    import io
    import pstats
    import threading

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.utils as dcp_utils
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager

    import allhands.checkpoint.checkpointer as ckpt_mod
    from allhands.checkpoint import Checkpointer, ModelOptimState

    cpu: dict[str, float] = defaultdict(float)  # part -> thread CPU seconds in this series
    calls: dict[str, int] = defaultdict(int)
    profiles: list[cProfile.Profile] = []

    def timed(name, fn):
        def wrapped(*a, **k):
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cpu[name] += time.thread_time() - c0
                calls[name] += 1
                if name.startswith("training"):  # wall time on the training thread: the stall
                    cpu[name.replace("training:", "training wall:")] += time.perf_counter() - w0
        return wrapped

    # The write thread's dcp.save (allhands.checkpoint.saver calls it through the module), profiled
    # on request. Only async saves run in this bench's series.
    orig_save = dcp.save

    def save_wrapper(*a, **k):
        c0 = time.thread_time()
        prof = cProfile.Profile() if cprofile else None
        if prof:
            prof.enable()
        try:
            return orig_save(*a, **k)
        finally:
            if prof:
                prof.disable()
                profiles.append(prof)
            cpu["upload: dcp save (all)"] += time.thread_time() - c0

    dcp.save = save_wrapper
    dcp_utils._DistWrapper.reduce_scatter = timed("upload: planning (reduce_scatter)",
                                                  dcp_utils._DistWrapper.reduce_scatter)
    dcp_utils._DistWrapper.all_reduce = timed("upload: write + finish (all_reduce)",
                                              dcp_utils._DistWrapper.all_reduce)
    FileSystemWriter.write_data = timed("upload: write_data", FileSystemWriter.write_data)
    FileSystemWriter.finish = timed("upload: finish (.metadata)", FileSystemWriter.finish)
    DefaultStager._stage = timed("stager: copy to host", DefaultStager._stage)
    ckpt_mod.write_manifest = timed("commit: manifest", ckpt_mod.write_manifest)
    Checkpointer._commit = timed("commit: all", Checkpointer._commit)
    Checkpointer.save = timed("training: Checkpointer.save", Checkpointer.save)
    Checkpointer.before_update = timed("training: before_update", Checkpointer.before_update)
    ModelOptimState.state_dict = timed("training: ModelOptimState.state_dict", ModelOptimState.state_dict)

    job = CheckpointBenchJob(cfg_dict)
    mesh, ts, state = job.mesh, job.ts, job.state
    main_tid = threading.get_native_id()
    step_cpu = [0.0]

    def steps(n: int, ckpt: Checkpointer | None) -> None:
        for _ in range(n):
            c0 = time.thread_time()
            job.backward()
            step_cpu[0] += time.thread_time() - c0
            if ckpt is not None:
                ckpt.before_update()
            c0 = time.thread_time()
            job.update()
            step_cpu[0] += time.thread_time() - c0

    ckpt = Checkpointer(Path(out) / "async", rank=mesh.rank, keep_last=1, mode="async",
                        group=mesh.checkpoint_group())
    steps(3, None)
    ckpt.save(ts.step, state)  # prepares the directory and the stager's host buffers
    ckpt.wait()
    names = {t.native_id: t.name for t in threading.enumerate()}
    rows = []
    for r in range(rounds * 2):
        mode = ("base", "async")[r % 2]
        cpu.clear()
        calls.clear()
        step_cpu[0] = 0.0
        t0, p0, th0 = time.perf_counter(), time.process_time(), _thread_cpu()
        for _ in range(saves):
            steps(interval, ckpt if mode == "async" else None)
            if mode == "async":
                ckpt.save(ts.step, state)
        if mode == "async":
            ckpt.wait()
        wall, proc, th1 = time.perf_counter() - t0, time.process_time() - p0, _thread_cpu()
        names.update({t.native_id: t.name for t in threading.enumerate()})
        per_thread: dict[str, float] = defaultdict(float)
        for tid, c in th1.items():
            label = "training thread" if tid == main_tid else names.get(tid, "native (gloo/torch)")
            label = "native (gloo/torch)" if label.startswith("Dummy") else label
            per_thread[label.split("_")[0] if label.startswith("ThreadPoolExecutor") else label] += c - th0.get(tid, 0.0)
        per_thread["gone threads (upload)"] = proc - sum(th1[t] - th0.get(t, 0.0) for t in th1)
        rows.append({"mode": mode, "wall": wall, "proc": proc, "threads": dict(per_thread),
                     "parts": dict(cpu), "calls": dict(calls), "step_cpu": step_cpu[0]})
    ckpt.close()
    assert ckpt.failures == 0, ckpt.warnings
    text = ""
    if profiles:
        buf = io.StringIO()
        stats = pstats.Stats(profiles[0], stream=buf)
        for p in profiles[1:]:
            stats.add(p)
        stats.sort_stats("tottime").print_stats(25)
        text = buf.getvalue()
    Path(out, f"profile-{mesh.rank}.json").write_text(json.dumps({"rows": rows, "cprofile": text}))
    mesh.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--interval", type=int, default=20)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()

    from allhands.config import load_config
    from allhands.launch.launcher import LaunchSpec, launch
    from allhands.launch.rundir import resolve_run

    out = tempfile.mkdtemp(prefix="allhands-bench-ckptprof-")
    cfg = load_config(overrides=[*MODEL, "run.global_batch=16", f"run.dir={out}/resolve",
                                 "log.progress=false", "log.tensorboard=false"])
    cfg = resolve_run(cfg, resume=None, world_size=2)
    launch(worker, (cfg.to_dict(), args.rounds, args.saves, args.interval, args.cprofile, out),
           LaunchSpec(nproc=2))
    print(f"rounds={args.rounds} saves={args.saves} interval={args.interval} ranks=2 model={' '.join(MODEL)} "
          f"global_batch=16; load average {os.getloadavg()[0]:.1f}")
    print("CPU ms per save (median over rounds; threads: async series minus the paired baseline)")
    for rank in (0, 1):
        res = json.loads(Path(out, f"profile-{rank}.json").read_text())
        rows = res["rows"]
        pairs = list(zip(rows[0::2], rows[1::2]))
        per = lambda f: statistics.median(f(b, a) for b, a in pairs) * 1e3 / args.saves  # noqa: E731
        print(f"rank {rank}: process {per(lambda b, a: a['proc'] - b['proc']):.1f} "
              f"(wall {per(lambda b, a: a['wall'] - b['wall']):.1f}; training thread's step CPU "
              f"{per(lambda b, a: a['step_cpu'] - b['step_cpu']):+.1f})")
        labels = sorted({k for _, a in pairs for k in a["threads"]} | {k for b, _ in pairs for k in b["threads"]})
        for k in labels:
            print(f"  thread {k:32s} {per(lambda b, a: a['threads'].get(k, 0) - b['threads'].get(k, 0)):8.1f}")
        for k in sorted({k for _, a in pairs for k in a["parts"]}):
            print(f"  part   {k:40s} {per(lambda b, a: a['parts'].get(k, 0)):8.1f}")
        if res["cprofile"]:
            print(res["cprofile"])


if __name__ == "__main__":
    main()
