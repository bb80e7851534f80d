"""What a step and a start cost beyond the math: the collectives each rank issues on a step that
does not log (only the gradients' own), on a logged one (one all_gather more), the heartbeat
that a background thread writes, and the start-up phases ``--verbose`` names.
docs/architecture.md ("What each rank does per step") is the contract."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from allhands.heartbeat import WRITE_EVERY_S, Heartbeat, read_heartbeats
from allhands.launch.launcher import LaunchSpec, launch
from allhands.launch.rundir import resolve_run

from conftest import ALLHANDS, ROOT, tiny_config

# Every collective a Python caller can issue; DDP's gradient buckets go through dist.all_reduce
# too (torch's default allreduce_hook and the PowerSGD hook call it), so they are counted.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
               "monitored_barrier", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv")


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value on the host (``item``, ``float``, ``bool``: ATen's
    ``_local_scalar_dense``), each a device-to-host sync on a GPU; ``on_read()`` is called for
    each too."""

    def __init__(self, on_read=lambda: None):
        super().__init__()
        self.reads, self.on_read = 0, on_read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
            self.on_read()
        return func(*args, **(kwargs or {}))


def _counting_worker(cfg_dict: dict, out: str, wrap: bool) -> None:
    """One rank: train with every torch.distributed collective wrapped (``wrap``; the pipeline's
    P2POp accepts only torch's own isend/irecv); write, per step, the collectives it issued, each
    tagged 'grad' when DDP's comm hook issued it, and the values read back to the host."""
    import traceback

    import torch.distributed as dist

    from allhands import agree
    from allhands.config import Config
    from allhands.env import worker_env
    from allhands.lockstep import build_mesh
    from allhands.trainer import Job, Trainer
    from allhands.worker import reported_failures

    with reported_failures():
        cfg, env = Config.from_dict(cfg_dict), worker_env()
        mesh = build_mesh(cfg, env)
        trainer = Trainer(cfg, Job(), mesh, Path(cfg.run.dir))
        agree.STOP_CHECK_S = 1e9  # after step 1's check, no stop check falls between logged steps
        calls: dict[int, list[str]] = {}
        current = [0]

        def counted(name, fn):
            def wrapper(*args, **kwargs):
                stack = "".join(traceback.format_stack(limit=12))
                tag = "grad" if "ddp_comm_hooks" in stack else "loop"
                calls.setdefault(current[0], []).append(f"{tag}:{name}")
                return fn(*args, **kwargs)
            return wrapper

        for name in COLLECTIVES if wrap else ():
            setattr(dist, name, counted(name, getattr(dist, name)))
        train_step = trainer.train_step
        reads: dict[int, int] = {}

        def read() -> None:
            reads[current[0]] = reads.get(current[0], 0) + 1

        tolist = torch.Tensor.tolist

        def counted_tolist(t):  # a CPU tensor's tolist reads memory without a dispatch: count it
            if current[0] in reads:
                reads[current[0]] += 1
            return tolist(t)

        torch.Tensor.tolist = counted_tolist

        def numbered(step: int):
            current[0] = step + 1
            reads[step + 1] = 0
            with HostReads(read):
                return train_step(step)

        trainer.train_step = numbered
        trainer.fit()
        (Path(out) / f"rank{mesh.rank}.json").write_text(json.dumps(calls))
        (Path(out) / f"reads{mesh.rank}.json").write_text(json.dumps(reads))
        mesh.destroy()


def _count(token_dir, tmp_path, *extra: str) -> Path:
    """Train 6 steps logging every 3rd on 2 ranks, counting; the folder of the counts."""
    cfg = tiny_config(token_dir, tmp_path / "run", "run.steps=6", "log.interval=3",
                      "data.eval_batches=0", "run.threads=1", *extra)
    cfg = resolve_run(cfg, resume=None, world_size=2)
    out = tmp_path / "out"
    out.mkdir()
    launch(_counting_worker, (cfg.to_dict(), str(out), not extra), LaunchSpec(nproc=2), threads=1)
    return out


def _host_reads(out: Path, rank: int) -> dict[int, int]:
    return {int(k): v for k, v in json.loads((out / f"reads{rank}.json").read_text()).items()}


def test_a_step_that_does_not_log_issues_only_the_gradients_collectives(token_dir, tmp_path):
    out = _count(token_dir, tmp_path)
    for rank in range(2):
        reads = _host_reads(out, rank)
        # no value read back to the host inside a step that does not log (on a GPU each read
        # waits for the device's queue): the clip's norm and the skip stay on the device
        assert [reads[s] for s in (2, 4, 5)] == [0, 0, 0], reads
        calls = {int(k): v for k, v in json.loads((out / f"rank{rank}.json").read_text()).items()}
        grads = [c for c in calls[2] if c.startswith("grad:")]
        assert grads and all(c == "grad:all_reduce" for c in grads), calls
        for step in (2, 4, 5):  # neither logged nor a stop check: the gradients' buckets only
            assert calls[step] == grads, (rank, step, calls)
        # step 1 also gathers every rank's memory for its one line, and makes the first stop check
        assert calls[1] == grads + ["loop:all_gather", "loop:all_reduce"], calls
        # a logged step: the record's one all_gather, which carries the stop request too (the
        # last step then waits for its checkpoint saves on every rank: barriers)
        assert calls[3] == grads + ["loop:all_gather"], (rank, calls)
        assert calls[6][:len(grads) + 1] == grads + ["loop:all_gather"], (rank, calls)


@pytest.mark.parametrize("layout", [["parallel.dp_shard=2", "parallel.zero=3"], ["parallel.tp=2"],
                                    ["parallel.pp=2"]], ids=["zero3", "tp2", "pp2"])
def test_a_step_that_does_not_log_reads_nothing_back_on_any_layout(token_dir, tmp_path, layout):
    """FSDP, tensor and pipeline parallel: the clip's norm over shards and stages, and the skip
    of a non-finite step, are decided on the device; only a logged step reads values back."""
    out = _count(token_dir, tmp_path, *layout)
    for rank in range(2):
        reads = _host_reads(out, rank)
        assert [reads[s] for s in (2, 4, 5)] == [0, 0, 0], (rank, reads)
        assert reads[3] > 0, (rank, reads)  # the logged step reads the verdict: the count sees reads


def test_heartbeat_after_the_first_steps_is_written_by_a_thread_with_the_beats_time(tmp_path):
    hb = Heartbeat(str(tmp_path), 0)
    for step in (5, 6, 7):  # the first three: at once, so a short attempt's progress is seen
        hb.beat(step)
        assert read_heartbeats(tmp_path)[0][1] == step
    t0 = time.time()
    hb.beat(8)
    hb.beat(9)
    t1 = time.time()
    assert hb._thread is not None  # not written at once: the loop only recorded them
    deadline = time.monotonic() + 60
    while read_heartbeats(tmp_path)[0][1] != 9 and time.monotonic() < deadline:
        time.sleep(WRITE_EVERY_S / 4)
    pid, step, t, _, done, first = read_heartbeats(tmp_path)[0]
    # The beat's time, not the write's (the thread's first write is WRITE_EVERY_S after beat 8).
    assert (step, first, done) == (9, 5, False) and t0 <= t <= t1
    time.sleep(3 * WRITE_EVERY_S)  # no new beat: the file keeps the beat's time, so it goes stale
    assert read_heartbeats(tmp_path)[0][2] == t
    hb.beat(10, done=True)
    assert read_heartbeats(tmp_path)[0][1:5:3] == (10, True) and hb._thread is None


def test_verbose_names_every_start_up_phase_up_to_the_first_step(tmp_path, cli_env):
    r = subprocess.run([*ALLHANDS, "train", str(ROOT / "examples" / "configs" / "tiny.toml"), "--nproc",
                        "2", "--verbose", "--set", "run.steps=2", "--set", f"run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, env=cli_env, timeout=300)
    assert r.returncode == 0, r.stderr
    said = re.findall(r"^allhands: (.+) took ([0-9.]+) s(?: \(([0-9.]+) s since the command\))?$",
                      r.stderr, re.M)
    names = [n for n, _, _ in said]
    assert names == ["importing torch and the launcher",
                     "the launcher's start (python, imports, config, run directory, worker server)",
                     "starting 2 workers", "the workers' rendezvous (process groups)",
                     "building the data, model and layout", "the first step"], r.stderr
    since = [float(s) for _, _, s in said[2:]]
    assert since == sorted(since) and float(said[1][1]) <= since[0]  # one clock, from the command
