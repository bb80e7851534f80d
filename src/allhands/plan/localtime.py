"""Step time of a layout on this machine's CPU workers, composed from the cached calibration
(calibrate.py) and the matmul rate measured at the layout's own GEMM shapes: never from a
measured step of the layout itself.

Per rank and per step (1F1B over ``m`` microbatches, ``a`` accumulation steps):

- compute = a m (kernel seconds of the busiest stage's forward + backward at the shapes it runs,
  timed here: its matmuls, for small matrices far below the CPU's peak, and the kernels whose
  time grows with the activations, attention, GELU and the norms) + a m blocks ``step_per_block``
  (eager ops: dispatcher, autograd, element-wise kernels), times ``contention`` when several
  workers share the cores, plus TP's measured cost per parallelized module and 1F1B's per
  stage and microbatch (P2P, schedule bookkeeping);
- bubble = a (p - 1) microbatch times (Narayanan et al. 2021, 1F1B);
- communication = calls x alpha + bytes x beta for each collective the layout issues (DDP's
  measured cost and its further buckets, ZeRO-1's measured update cost per tensor, FSDP2's
  per-unit cost and its gathered and reduced bytes, TP's all-gathered and reduce-scattered bytes, the
  pipeline's sent bytes), exposed except where backward can hide it (DDP buckets before the last);
- per step: ``step_fixed`` + ``step_per_param`` x the parameters this rank updates, and the
  measured cost per DTensor parameter of clipping and AdamW: more for each one whose gradient is
  Partial under sequence-parallel TP (its all-reduces, repeated by every op that reads it).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from allhands.config import Config
from allhands.env import cache_dir
from allhands.flops import _cpu_name
from allhands.plan.decoder import Decoder

DDP_FIRST_BUCKET = 2 ** 20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
# What calibrate.py's figures mean; a cache made by another method is measured again. 2: the
# fastest repetition of each probe (not medians that other processes' load inflates), attention,
# GELU and norms timed apart by kernel_seconds (not inside step_per_block); 4: contention from a
# data-parallel training run beside a 1-worker one (kernels timed side by side in isolation run
# at full speed, while two training workers slow each other by a third or more); 5: a worker's
# runtime memory from that data-parallel run (with gloo's connections to its peers).
METHOD = 5


def calibration_key(nproc: int) -> str:
    threads = max(1, (os.cpu_count() or 1) // nproc)
    # "forked": a worker forked from the preloaded server (launch/forkstart.py) has another
    # resident set than a spawned one, so a calibration from spawned workers is not reused.
    return f"{_cpu_name()}|nproc={nproc}|threads={threads}|torch {torch.__version__}|forked"


def calibration_path():
    return cache_dir() / "local_calibration.json"


def cached_calibration(nproc: int) -> dict | None:
    """calibrate.py's figures for ``nproc`` workers on this machine, or None when not measured."""
    try:
        got = json.loads(calibration_path().read_text()).get(calibration_key(nproc))
    except (OSError, ValueError):
        return None
    return got if got and got.get("method") == METHOD else None


PARTIAL_REDUCES = 4  # all-reduces of each Partial gradient a step (partial_grad_tensors)


def partial_grad_tensors(cfg: Config, blocks: int, last: bool) -> int:
    """Parameters of a pipeline stage whose gradient is a Partial DTensor after backward under
    TP (parallel/tensor.py's plans; decoder.py counts them): the sequence-parallel norms'
    weights and biases, whose inputs are sharded over the sequence (Qwen3's per-head q/k norms,
    over the heads), so each rank holds a partial sum of their gradients. DTensor all-reduces
    each such gradient in every op that reads it, and does not keep the result: the norm for
    clipping, AdamW's ``lerp_(grad)`` and ``addcmul_(grad, grad)`` (torch/optim/adam.py), four a step."""
    return Decoder.of(cfg.model).partial_grads(blocks, last, cfg.parallel.tp_sequence_parallel)


@functools.lru_cache(maxsize=None)
def _mm_seconds(m: int, k: int, n: int, threads: int) -> float:
    """Seconds of ``(m, k) @ (k, n)`` in fp32 on ``threads`` threads: the fastest of many
    (calibrate.py's statistic)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        reps = max(5, min(200, int(2e7 / max(1, m * k * n))))
        for _ in range(3):
            torch.mm(a, b)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)
    finally:
        torch.set_num_threads(before)


def _train_mm(m: int, k: int, n: int, threads: int, count: int = 1) -> float:
    """Forward ``(m,k)@(k,n)`` and its two backward matmuls (input and weight gradients)."""
    return count * (_mm_seconds(m, k, n, threads) + _mm_seconds(m, n, k, threads)
                    + _mm_seconds(k, m, n, threads))


@functools.lru_cache(maxsize=None)
def _op_seconds(op: str, shape: tuple[int, ...], threads: int) -> float:
    """Seconds of a forward + backward of ``op`` (the reference GPT's causal attention over
    (B, heads, T, d) queries, keys and values; its GELU; a LayerNorm over the last dim) on
    ``threads`` threads: the fastest of many. On a CPU these run far slower per FLOP than a matmul
    (flash attention's CPU kernel recomputes its scores in backward; GELU evaluates erf), so the
    eager cost per block measured at the calibration's tiny shapes misses them at larger ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = [torch.randn(shape, requires_grad=True) for _ in range(3 if op == "attention" else 1)]
        fn = {"attention": lambda: F.scaled_dot_product_attention(*x, is_causal=True),
              "gelu": lambda: F.gelu(x[0]),
              "layernorm": lambda: F.layer_norm(x[0], shape[-1:])}[op]
        grad = torch.ones(shape)
        reps = max(5, min(100, int(4e6 / max(1, math.prod(shape)))))
        times = []
        for i in range(reps + 3):
            t0 = time.perf_counter()
            fn().backward(grad)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return min(times)
    finally:
        torch.set_num_threads(before)


def kernel_seconds(cfg: Config, samples: float, tp: int, blocks: int, head: bool, threads: int = 0) -> float:
    """Seconds of one forward + backward of ``blocks`` blocks of the model (and the vocabulary
    head when ``head``) over ``samples`` sequences, sharded ``tp`` ways, in their matmuls
    (decoder.py's list) and the kernels that scale with the activations (attention, the
    feed-forward's activation, two norms; _op_seconds), each timed at its own shape. A Llama
    block's SiLU and RMSNorm are timed as GELU and LayerNorm, kernels of the same passes."""
    d = Decoder.of(cfg.model)
    threads = threads or max(1, torch.get_num_threads())
    rows = max(1, int(samples * d.t))
    norm_rows = max(1, rows // tp) if tp > 1 and cfg.parallel.tp_sequence_parallel else rows
    block = sum(_train_mm(rows, i // (1 if col else tp), o // tp if col else o, threads)
                for i, o, col in d.matmuls())
    block += (_op_seconds("attention", (max(1, int(samples)), max(1, d.n_head // tp), d.t, d.hd), threads)
              + _op_seconds("gelu", (rows, d.ffn // tp), threads) * (2 if d.llama else 1)
              + 2 * _op_seconds("layernorm", (norm_rows, d.c), threads))
    return blocks * block + (_train_mm(rows, d.c, d.v // tp, threads) if head else 0.0)


def _coll(cal: dict, op: str, nbytes: float, calls: float = 1.0) -> float:
    alpha, beta = cal[op]
    return calls * alpha + nbytes * beta


def local_step(cfg: Config, layout, cal: dict, *, blocks: list[int], numel: list[int],
               tensors: list[int], threads: int) -> dict[str, float]:
    """Seconds per step of ``layout`` (estimate.Layout) on this machine: compute, bubble,
    communication (all exposed but the hidden DDP buckets), optimizer and loop overhead."""
    r, mdl = cfg.run, cfg.model
    tp, pp, n = layout.tp, layout.pp, layout.dp_shard
    mb = r.global_batch / (layout.dp * r.micro_batches * layout.microbatches)
    passes = r.micro_batches * layout.microbatches
    tok_bytes = mb * mdl.seq_len * mdl.n_embd * 4.0
    stage_t = []
    for s in range(pp):
        t_mb = kernel_seconds(cfg, mb, tp, blocks[s], s == pp - 1, threads) + cal["step_per_block"] * blocks[s]
        t_mb *= cal["contention"] if layout.world > 1 else 1.0
        if pp > 1:  # the schedule's own cost per microbatch (P2P, stage bookkeeping)
            t_mb += cal["pp_microbatch"]
        if tp > 1:  # parallel/tensor.py's plan's parallelized modules (decoder.py); bytes of the
            # sequence-parallel all-gather before and reduce-scatter after each half-block
            modules = Decoder.of(mdl).tp_modules(blocks[s], s == 0, s == pp - 1)
            t_mb += cal["tp_step"] + modules * cal["tp_module"] + blocks[s] * 2 * (
                tok_bytes / tp * cal["allgather"][1] + tok_bytes * cal["reducescatter"][1])
        stage_t.append(t_mb)
    busiest = max(range(pp), key=lambda s: stage_t[s])
    t_mb = stage_t[busiest]
    compute = passes * t_mb
    bubble = r.micro_batches * (pp - 1) * t_mb
    p_numel, p_tensors = numel[busiest], tensors[busiest]
    pbytes = 4.0 * p_numel
    bwd = compute * 2 / 3
    comm = _coll(cal, "allreduce", 4)  # every rank's non-finite vote
    hidden = 0.0
    if layout.dp > 1 and layout.zero <= 1:  # DDP buckets: all but the last overlap backward
        buckets = 1 + max(0, math.ceil((pbytes - DDP_FIRST_BUCKET) / (cfg.parallel.bucket_mb * 2 ** 20)))
        # DDP's per-step cost and its per-parameter hooks (per half-block in the probe)
        reduce = cal["ddp_step"] + 2 * blocks[busiest] * cal["ddp_half"] \
            + _coll(cal, "allreduce", pbytes, buckets - 1)
        hidden = min(reduce * (buckets - 1) / buckets, bwd)
        comm += reduce
        if layout.zero == 1:  # ZeroRedundancyOptimizer broadcasts every parameter from its owner:
            # its measured cost per tensor (the probe's bytes are few) and the bytes
            comm += cal["zero1_update_tensor"] * p_tensors + pbytes * cal["broadcast"][1]
    elif layout.zero >= 2:  # one FSDP2 unit per block and the root
        units = blocks[busiest] + 1
        gathers = 2 if layout.zero == 3 else 1
        comm += passes * (cal[f"fsdp_step_zero{layout.zero}"] + units * cal[f"fsdp_unit_zero{layout.zero}"])
        comm += passes * (gathers * pbytes * cal["allgather"][1] + pbytes * cal["reducescatter"][1])
        comm += 2 * _coll(cal, "allreduce", 4)  # the sharded gradient norm, its full_tensor
        if layout.dp_replicate > 1:
            comm += _coll(cal, "allreduce", pbytes / n, units)
    if tp > 1:
        comm += _coll(cal, "allreduce", 4, 2)  # the norm over tp shards
    if pp > 1:  # activation and gradient bytes (the hops' latency is in pp_microbatch)
        comm += passes * 2 * tok_bytes / tp * cal["sendrecv"][1]
        comm += _coll(cal, "allreduce", 4) + (_coll(cal, "allreduce", 4.0 * (mdl.vocab_size or 257)
                                                    * mdl.n_embd / tp) if mdl.tie_embeddings else 0.0)
    shard = n if layout.zero >= 1 else 1
    optim = cal["step_fixed"] + cal["step_per_param"] * p_numel / shard
    if layout.zero >= 2 or tp > 1:  # the update runs over DTensor parameters, some with Partial
        # gradients that each op reads through an all-reduce of their own (tp > 1)
        partial = partial_grad_tensors(cfg, blocks[busiest], busiest == pp - 1) if tp > 1 else 0
        optim += cal["dtensor_update_tensor"] * (p_tensors - partial) + cal["partial_grad_tensor"] * partial
    step = compute + bubble + comm - hidden + optim
    return {"compute": compute, "bubble": bubble, "comm": comm, "comm_exposed": comm - hidden,
            "optimizer": optim, "step": step}
