"""This machine measured once for ``--cluster local`` (cached in ``cache_dir()/local_calibration.json``
per CPU, worker count, threads and torch version): what the planner's local step-time and memory
model is made of, never the step of the layout it predicts.

- The probes (probes.py), in ``nproc`` gloo processes on loopback: each collective's latency
  and seconds per byte (Hockney's alpha-beta model); what DDP, FSDP2 and sequence-parallel TP
  add to a forward + backward, per step and per unit; the update's extra cost per DTensor,
  Partial-gradient and ZeRO-1 parameter; 1F1B's cost per microbatch.

Every figure is the fastest of its repetitions, not their median: on a machine shared with other
jobs, other processes only ever add time to a repetition (a descheduled rank stalls its peers'
collectives for a whole time slice), so the minimum estimates the cost itself and is the one
statistic that repeats from run to run (timeit's advice); plan.check measures the best step alike.
- Three 1-process training runs of the reference GPT at different depth and width, through the
  real launcher: what a step costs beyond its kernels (matmuls, attention, GELU, norms: timed at
  each shape, localtime.kernel_seconds), fitted as ``fixed + per_block * blocks + per_param * params``
  (eager ops per block; the optimizer and the gradient clipping per parameter); and the worker's
  resident set beyond its tensors (interpreter, torch, gloo), the ``runtime`` of every worker.
- Two more, of one GPT on one worker and data-parallel on ``nproc``: how much slower a worker
  computes beside the others (``contention``), and the resident set of a worker beside others
  (with gloo's connections to its peers), the ``runtime`` when ``nproc`` > 1.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from allhands.plan.localtime import METHOD, cached_calibration, calibration_key, calibration_path
from allhands.plan.probes import probe_worker


def probe_comm(nproc: int) -> dict:
    """Run the probe on ``nproc`` local processes; the figures rank 0 measured."""
    import torch.multiprocessing as mp  # start-up time: only the probe spawns processes

    with tempfile.TemporaryDirectory(prefix="allhands-probe-") as tmp:
        out = Path(tmp) / "probe.json"
        mp.spawn(probe_worker, (nproc, str(Path(tmp) / "store"), str(out)), nprocs=nproc)
        return json.loads(out.read_text())


# The reference GPTs timed: (n_layer, n_embd); depth and width vary apart, so that eager-op cost
# per block and per-parameter cost come from separate differences.
STEP_RUNS = ((2, 32), (4, 32), (2, 128))


def _gpt_costs(n_layer: int, n_embd: int, threads: int, reps: int = 30) -> tuple[float, float, int]:
    """(seconds of a forward + backward of 12 sequences of 16 tokens, seconds of clipping + AdamW
    + zero_grad, parameters) of a reference GPT in this process: the fastest of ``reps``, each
    timed alternately with the other."""
    from allhands.job import lm_loss
    from allhands.models import GPT, GPTConfig

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = GPT(GPTConfig(vocab_size=257, seq_len=16, n_layer=n_layer, n_head=2, n_embd=n_embd,
                              bias=False))
        params = list(model.parameters())
        opt = torch.optim.AdamW(params)
        x = torch.randint(0, 257, (12, 16))
        best = [float("inf"), float("inf")]
        for i in range(reps + 3):
            t0 = time.perf_counter()
            lm_loss(model(x), x).backward()
            t1 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 3:
                best = [min(best[0], t1 - t0), min(best[1], time.perf_counter() - t1)]
        return best[0], best[1], sum(p.numel() for p in params)
    finally:
        torch.set_num_threads(before)


def _gpt_config(n_layer: int, n_embd: int, threads: int, seq_len: int = 16, batch: int = 12):
    """A calibration run's reference GPT (2 heads, no biases) and plan.check's quiet settings."""
    from allhands.config import Config, apply_override
    from allhands.plan.check import QUIET

    cfg = Config()
    for item in ("model.bias=false", f"model.n_layer={n_layer}", "model.n_head=2", f"model.n_embd={n_embd}",
                 f"model.seq_len={seq_len}", f"run.global_batch={batch}", f"run.threads={threads}", *QUIET):
        apply_override(cfg, item)
    return cfg


def _step_configs(threads: int) -> list:
    return [_gpt_config(n_layer, n_embd, threads) for n_layer, n_embd in STEP_RUNS]


def _train(cfg, world: int, run_dir: Path, steps: int):
    """Train ``cfg`` data-parallel on ``world`` workers through the launcher: (its fastest step
    after the warm-up, as check measures, a worker's resident set beyond its modelled tensors,
    the estimate those tensors come from)."""
    from allhands.plan.check import run_layout
    from allhands.plan.cluster import local_cluster
    from allhands.plan.estimate import Layout, estimate

    est = estimate(cfg, Layout(world, 1, 1, 1, 0), local_cluster(world, calibrated=False), False)
    got = run_layout(cfg, est, world, run_dir, steps)
    return got.step_time, got.peak - (est.memory["total"] - est.memory["buffers"]), est


def probe_step_costs(nproc: int) -> dict:
    """Eager ops per block and the update per parameter, from the reference GPTs timed in this
    process (the fastest of many: robust to load) less their modelled kernels."""
    from allhands.plan.localtime import kernel_seconds

    threads = max(1, (os.cpu_count() or 1) // nproc)  # as each of the nproc workers will run
    cfgs = _step_configs(threads)
    costs = [_gpt_costs(n_layer, n_embd, threads) for n_layer, n_embd in STEP_RUNS]
    kern = [kernel_seconds(cfg, 12, 1, cfg.model.n_layer, True, threads) for cfg in cfgs]
    (p2, u2, n2), (p4, _, _), (_, u128, n128) = costs
    return {"step_per_block": max(0.0, ((p4 - kern[1]) - (p2 - kern[0])) / 2),
            "step_per_param": max(0.0, (u128 - u2) / (n128 - n2))}


def probe_steps(nproc: int, per_block: float, per_param: float, steps: int = 8) -> dict:
    """The trainer's own per-step cost as the least that three 1-worker training runs through the
    launcher leave over their kernels, ``per_block`` eager seconds a block and ``per_param``
    update seconds a parameter (probe_step_costs); the worker's resident set beyond its modelled
    tensors."""
    from allhands.plan.localtime import kernel_seconds

    threads = max(1, (os.cpu_count() or 1) // nproc)
    residual, runtime = [], []
    with tempfile.TemporaryDirectory(prefix="allhands-calibrate-") as tmp:
        for i, cfg in enumerate(_step_configs(threads)):
            step, rss, est = _train(cfg, 1, Path(tmp) / f"run-{i}", steps)
            numel = sum(est.state_rank) / 16  # fp32 parameters + gradients + two AdamW moments
            kern = kernel_seconds(cfg, 12, 1, cfg.model.n_layer, True, threads)
            residual.append(step - kern - per_block * cfg.model.n_layer - per_param * numel)
            runtime.append(rss)
    return {"step_fixed": max(0.0, min(residual)), "runtime": statistics.median(runtime)}


# A data-parallel run of this reference GPT on nproc workers, and one on one worker with the same
# batch per worker: (n_layer, n_embd, seq_len, sequences per worker), steps of tens of ms here
CONTENTION_RUN = (2, 128, 64, 8)


def probe_contention(nproc: int, cal: dict, steps: int = 20) -> tuple[float, float | None]:
    """How much slower a worker's compute runs with ``nproc`` workers training side by side than
    alone: the caches, memory bandwidth and cores they share, and the communication threads
    running beside the compute. Timed on real training steps through the launcher (kernels timed
    side by side in isolation run at full speed here, while two training workers slow each other
    by half or more): the ``nproc``-worker step less its modelled communication and update, over
    its modelled compute scaled by how far the 1-worker step is from its own prediction. And a
    worker's resident set beyond its tensors when ``nproc`` of them run (each holds gloo's
    connections and buffers to its peers, which a lone worker has not): ``runtime``."""
    from allhands.plan.estimate import Layout, stage_params
    from allhands.plan.localtime import local_step

    if nproc < 2:
        return 1.0, None
    n_layer, n_embd, seq, per_worker = CONTENTION_RUN
    threads = max(1, (os.cpu_count() or 1) // nproc)
    flat = {**cal, "contention": 1.0}
    got = []
    with tempfile.TemporaryDirectory(prefix="allhands-calibrate-") as tmp:
        for world in (1, nproc):
            cfg = _gpt_config(n_layer, n_embd, threads, seq, per_worker * world)
            numel, tensors = stage_params(cfg, 1, 1, 0)
            pred = local_step(cfg, Layout(world, 1, 1, 1, 0), flat, blocks=[n_layer], numel=[numel],
                              tensors=[tensors], threads=threads)
            step, rss, _ = _train(cfg, world, Path(tmp) / f"run-{world}", steps)
            got.append((step, pred, rss))
    (one, pred_one, _), (many, pred_many, runtime) = got
    return contention_factor(one, pred_one, many, pred_many), runtime


def contention_factor(one: float, pred_one: dict, many: float, pred_many: dict) -> float:
    """From measured steps ``one`` (1 worker) and ``many`` (data-parallel, the same batch per
    worker) and their predictions at contention 1 (localtime.local_step): the factor on the
    many-worker compute that its step needs beyond the modelled communication and update, once
    the model's own error on one worker is taken out."""
    scale = one / pred_one["step"]
    return max(1.0, (many - (pred_many["step"] - pred_many["compute"])) / (pred_many["compute"] * scale))


ROUNDS = 3  # probe runs a calibration takes the median of


def _median(runs: list[dict]) -> dict:
    """Each figure's median over probe runs (an alpha-beta pair element-wise). Each run's figure
    is already the fastest of its repetitions, but a framework's cost is a difference of two
    such minima, and a single run of it can land anywhere between zero and twice its value."""
    return {k: [statistics.median(v) for v in zip(*(r[k] for r in runs))] if isinstance(runs[0][k], list)
            else statistics.median(r[k] for r in runs) for k in runs[0]}


def calibrate(nproc: int, *, force: bool = False, probes_only: bool = False,
              recent: list[dict] | None = None) -> dict:
    """The calibration for ``nproc`` workers: cached, else measured (about two minutes) and
    cached: the median of ROUNDS probe runs and five launcher runs. ``probes_only`` measures the
    probes again (gloo, the frameworks, the per-block and per-parameter costs) and keeps the
    cached figures of the launcher runs (the trainer's fixed cost per step, the worker's resident
    set, contention). ``recent``, the caller's list of earlier probe runs, is added to and
    the median taken over its last ROUNDS, so that a caller measuring again and again (check's
    refresh) pays one probe run each time after the first."""
    if not force and (hit := cached_calibration(nproc)) is not None:
        return hit
    kept = cached_calibration(nproc) if probes_only else None
    recent = [] if recent is None else recent
    rounds = max(1, ROUNDS - len(recent))
    print(f"allhands plan: measuring this machine for {nproc} workers{'' if kept else ' once'} "
          f"(about {'two minutes' if not kept else 'a minute' if rounds > 1 else 'half a minute'}; cached in "
          f"{calibration_path()})", file=sys.stderr, flush=True)
    for _ in range(rounds):
        recent.append({**probe_comm(max(2, nproc)), **probe_step_costs(nproc)})
    del recent[:-ROUNDS]
    probes = _median(recent)
    if kept:
        runs = {k: kept[k] for k in ("step_fixed", "runtime", "contention")}
    else:
        runs = probe_steps(nproc, probes["step_per_block"], probes["step_per_param"])
        runs["contention"], runtime = probe_contention(nproc, {**probes, **runs})
        runs["runtime"] = runtime or runs["runtime"]
    result = {**probes, **runs, "measured_at": time.time(), "method": METHOD}
    path = calibration_path()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table[calibration_key(nproc)] = result
    try:  # beside and renamed, as flops.cpu_gemm_peak does
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return result


def recalibrated(cfg, nproc: int):
    """``check``'s ``refresh`` for this machine: before each layout runs, the probes are measured
    again (``probes_only``) and the layout predicted from the median of the last ROUNDS probe
    runs, so that a prediction and the run it is checked against see about the same load of other
    processes, not the load of minutes before."""
    from allhands.plan.cluster import local_cluster  # plan.cluster imports the calibration's cache
    from allhands.plan.estimate import estimate

    recent: list[dict] = []

    def refresh(est):
        calibrate(nproc, force=True, probes_only=True, recent=recent)
        bf16 = cfg.run.precision == "bf16"
        return estimate(cfg, est.layout, local_cluster(nproc), bf16)

    return refresh
