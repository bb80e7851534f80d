"""Validating the config tree before any worker starts: every problem is a ConfigError whose
message starts with the dotted path of the field and says what is allowed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from allhands.config.pipeline import (PP_SCHEDULES, check_microbatches, check_stages_per_rank,
                                      pp_microbatches)
from allhands.config.tree import Config, FaultConfig, ParallelConfig
from allhands.errors import ConfigError


def _check(ok: bool, path: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{path}: {value!r} is not allowed; {allowed}")


def validate(cfg: Config, world_size: int | None = None, need_data: bool = True) -> None:
    """Raise ConfigError for the first impossible value. ``world_size`` enables batch checks."""
    m, o, r, p, c, lg, d = cfg.model, cfg.optim, cfg.run, cfg.parallel, cfg.checkpoint, cfg.log, cfg.data
    for name in ("n_layer", "n_head", "n_embd", "seq_len"):
        _check(getattr(m, name) >= 1, f"model.{name}", "must be >= 1", getattr(m, name))
    _check(m.n_embd % m.n_head == 0, "model.n_embd",
           f"must be divisible by model.n_head={m.n_head}", m.n_embd)
    _check(m.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 = from the tokenizer)", m.vocab_size)
    _check(0.0 <= m.dropout < 1.0, "model.dropout", "must be in [0, 1)", m.dropout)
    _check(o.lr > 0, "optim.lr", "must be > 0", o.lr)
    _check(0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio", "must be in [0, 1]", o.min_lr_ratio)
    _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0", o.warmup_steps)
    _check(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0", o.weight_decay)
    _check(0.0 <= o.beta1 < 1.0, "optim.beta1", "must be in [0, 1)", o.beta1)
    _check(0.0 <= o.beta2 < 1.0, "optim.beta2", "must be in [0, 1)", o.beta2)
    _check(o.eps > 0, "optim.eps", "must be > 0", o.eps)
    _check(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)", o.grad_clip)
    _check(o.name in ("adamw", "sgd"), "optim.name", "allowed: adamw, sgd", o.name)
    _check(p.sync in SYNC_MODES, "parallel.sync", "allowed: " + ", ".join(SYNC_MODES), p.sync)
    _validate_sync(cfg)
    _check(p.backend in ("auto", "gloo", "nccl"), "parallel.backend", "allowed: auto, gloo, nccl", p.backend)
    _check(p.bucket_mb > 0, "parallel.bucket_mb", "must be > 0", p.bucket_mb)
    _check(p.timeout_s > 0, "parallel.timeout_s", "must be > 0", p.timeout_s)
    _check_parallel(p)
    _check(c.interval >= 0, "checkpoint.interval", "must be >= 0 (0 = only at the end)", c.interval)
    _check(c.keep_last >= 1, "checkpoint.keep_last", "must be >= 1", c.keep_last)
    _check(c.mode in ("async", "sync"), "checkpoint.mode", "allowed: async, sync", c.mode)
    _check(0 <= c.max_overhead < 1, "checkpoint.max_overhead", "must be in [0, 1), e.g. 0.02", c.max_overhead)
    _validate_fault(cfg.fault)
    _validate_replica(cfg)
    _check(lg.interval >= 1, "log.interval", "must be >= 1", lg.interval)
    _check(lg.progress_s >= 0, "log.progress_s", "must be >= 0 (0 disables the plain progress lines)",
           lg.progress_s)
    _check(d.eval_batches >= 0, "data.eval_batches", "must be >= 0", d.eval_batches)
    _check(r.steps >= 1, "run.steps", "must be >= 1", r.steps)
    _check(r.global_batch >= 1, "run.global_batch", "must be >= 1", r.global_batch)
    _check(r.micro_batches >= 1, "run.micro_batches", "must be >= 1", r.micro_batches)
    _check(r.eval_interval >= 0, "run.eval_interval", "must be >= 0", r.eval_interval)
    _check(r.threads >= 0, "run.threads", "must be >= 0 (0 = cores / workers)", r.threads)
    _check(r.device in ("auto", "cpu", "cuda"), "run.device", "allowed: auto, cpu, cuda", r.device)
    _check(r.precision in ("auto", "fp32", "bf16"), "run.precision", "allowed: auto, fp32, bf16", r.precision)
    _check(bool(r.name) and "/" not in r.name, "run.name", "must be non-empty and contain no '/'", r.name)
    if r.compile:
        for dim in ("pp", "tp"):
            if getattr(p, dim) != 1:
                raise ConfigError(f"run.compile: true is not supported with parallel.{dim}="
                                  f"{getattr(p, dim)}; set run.compile=false or parallel.{dim}=1")
    if p.backend == "nccl" and r.device == "cpu":
        raise ConfigError("parallel.backend: 'nccl' needs run.device=cuda; use gloo or auto on CPU")
    if world_size is not None:
        if p.sync == "ps":
            _check(world_size > cfg.ps.servers, "ps.servers",
                   f"must be fewer than the job's {world_size} ranks (the rest are workers)", cfg.ps.servers)
            world_size -= cfg.ps.servers  # the mesh spans the workers
        sizes = mesh_sizes(p, world_size)
        _check_sharding(p, sizes)
        dp = sizes["dp_replicate"] * sizes["dp_shard"]
        per = dp * r.micro_batches
        _check(r.global_batch % per == 0, "run.global_batch",
               f"must be divisible by data-parallel ranks x micro_batches = {dp} x {r.micro_batches} = {per}",
               r.global_batch)
        _check_tp_pp(cfg, sizes)
    if c.init_from and not Path(c.init_from).exists():
        raise ConfigError(f"checkpoint.init_from: {c.init_from!r} does not exist; pass a .safetensors "
                          f"file or a transformers directory written by `allhands export`")
    if need_data:
        _check_data(cfg)


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """``DIR:WEIGHT[,DIR:WEIGHT...]`` of data.mix as ``[(dir, weight), ...]``."""
    out = []
    for item in spec.split(","):
        path, _, w = item.strip().rpartition(":")
        try:
            weight = float(w)
        except ValueError:
            weight = -1.0
        if not path or not weight > 0:
            raise ConfigError(f"data.mix: {item.strip()!r} is not allowed; each item is DIR:WEIGHT "
                              f"with WEIGHT > 0, e.g. data/web:0.7,data/code:0.3")
        out.append((path, weight))
    return out


def _check_data(cfg: Config) -> None:
    """The prepared directories exist, and the model's vocabulary holds the data's."""
    d, m = cfg.data, cfg.model
    if d.mix and d.path:
        raise ConfigError(f"data.mix: {d.mix!r} replaces data.path; set one of them, not both")
    field = "data.mix" if d.mix else "data.path"
    for path, _ in parse_mix(d.mix) if d.mix else [(d.path, 1.0)] if d.path else []:
        meta = Path(path) / "meta.json"
        if not meta.is_file():
            raise ConfigError(f"{field}: {path!r} has no meta.json; make it with "
                              f"`allhands prepare INPUTS --out {path}`" +
                              ("" if d.mix else " or leave data.path empty"))
        try:
            vocab = int(json.loads(meta.read_text()).get("vocab_size", 0))
        except (ValueError, TypeError):
            continue  # a damaged meta.json is named by the data loader, with its fix
        if m.vocab_size and vocab > m.vocab_size:
            raise ConfigError(f"model.vocab_size: {m.vocab_size} is smaller than the vocabulary "
                              f"{vocab} of {path!r}; use 0 to take it from the data, or >= {vocab}")


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def _check_dims(p: ParallelConfig) -> None:
    for dim in MESH_DIMS:
        v = getattr(p, dim)
        _check(v == -1 or v >= 1, f"parallel.{dim}", "must be -1 (the rest of the workers) or >= 1", v)
    rest = [d for d in MESH_DIMS if getattr(p, d) == -1]
    if len(rest) > 1:
        raise ConfigError(f"parallel.{rest[1]}: only one mesh dim may be -1 (the rest of the workers), "
                          f"but {' and '.join('parallel.' + d for d in rest)} are; set all but one")


def _check_parallel(p: ParallelConfig) -> None:
    """Checks of the parallel section that need no world size."""
    _check_dims(p)
    _check(p.zero in (0, 1, 2, 3), "parallel.zero", "allowed: 0 (DDP), 1, 2, 3", p.zero)
    _check(p.ac in ("none", "block", "selective"), "parallel.ac", "allowed: none, block, selective", p.ac)
    _check(p.reduce_dtype in ("fp32", "bf16"), "parallel.reduce_dtype", "allowed: fp32, bf16",
           p.reduce_dtype)
    if p.dp_shard not in (1, -1) and p.zero == 0 and p.sync not in ("diloco", "local_sgd"):
        raise ConfigError(f"parallel.zero: 0 (plain DDP) replicates everything, but parallel.dp_shard="
                          f"{p.dp_shard} asks to shard; set parallel.zero to 1, 2 or 3, or dp_shard=1")
    _check(p.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", f"allowed: {', '.join(PP_SCHEDULES)}",
           p.pp_schedule)
    _check(p.pp_microbatches >= 0, "parallel.pp_microbatches", "must be >= 0 (0 = one per stage)",
           p.pp_microbatches)
    _check(p.pp_stages_per_rank >= 0, "parallel.pp_stages_per_rank", "must be >= 0 (0 = automatic)",
           p.pp_stages_per_rank)


def mesh_sizes(p: ParallelConfig, world_size: int) -> dict[str, int]:
    """The four mesh sizes for ``world_size`` workers, the one -1 resolved; raises ConfigError
    with the arithmetic when they do not multiply to the world size."""
    _check_dims(p)
    given = {d: getattr(p, d) for d in MESH_DIMS}
    fixed = 1
    for v in given.values():
        fixed *= v if v != -1 else 1
    shown = " x ".join(f"{d}={v}" for d, v in (("dp_replicate", p.dp_replicate),
                                                  ("dp_shard", p.dp_shard), ("tp", p.tp), ("pp", p.pp)))
    rest = [d for d, v in given.items() if v == -1]
    if rest:
        if world_size % fixed:
            raise ConfigError(f"parallel: {shown}: the fixed dims multiply to {fixed}, which does not "
                              f"divide the job's {world_size} workers; change the sizes or the worker count")
        given[rest[0]] = world_size // fixed
    elif fixed != world_size:
        raise ConfigError(f"parallel: {shown} = {fixed}, but the job has {world_size} workers; "
                          f"make the product {world_size} or set one dim to -1")
    return given


def _check_sharding(p: ParallelConfig, sizes: dict[str, int]) -> None:
    """Layout rules that need the resolved sizes."""
    if p.zero > 0 and sizes["dp_shard"] == 1 and sizes["dp_replicate"] > 1:
        raise ConfigError(f"parallel.zero: {p.zero} shards over parallel.dp_shard, which is 1 here, so "
                          f"nothing would be sharded; set parallel.dp_shard (e.g. -1 with "
                          f"parallel.dp_replicate=1) or parallel.zero=0")


def _check_tp_pp(cfg: Config, sizes: dict[str, int]) -> None:
    """Tensor/pipeline layouts the reference model and the batch cannot honour, caught before
    start instead of as a shape error or a hang inside a collective."""
    m, p, r = cfg.model, cfg.parallel, cfg.run
    tp, pp = sizes["tp"], sizes["pp"]
    if tp > 1:
        if tp > m.n_head:
            raise ConfigError(f"parallel.tp: {tp} is larger than model.n_head={m.n_head}; every tensor-"
                              f"parallel rank needs at least one attention head, use tp <= {m.n_head}")
        if m.n_head % tp:
            raise ConfigError(f"parallel.tp: {tp} does not divide model.n_head={m.n_head}; heads are split "
                              f"evenly over tp ranks, use a divisor of {m.n_head}")
        if p.zero < 2 and sizes["dp_replicate"] * sizes["dp_shard"] > 1:
            raise ConfigError(f"parallel.zero: {p.zero} replicates over DDP, which cannot hold the tp-"
                              f"sharded (DTensor) parameters; with parallel.tp={tp} use parallel.zero=2 or 3 "
                              f"(FSDP composes with tp), or no data parallelism")
        if p.tp_sequence_parallel and m.seq_len % tp:
            raise ConfigError(f"parallel.tp: {tp} does not divide model.seq_len={m.seq_len}, which sequence "
                              f"parallelism shards; change one or set parallel.tp_sequence_parallel=false")
    if pp > 1 and p.zero == 1:
        raise ConfigError(f"parallel.zero: 1 (ZeroRedundancyOptimizer over DDP) does not run under "
                          f"pipeline stages; with parallel.pp={pp} use parallel.zero=2 or 3, or 0")
    v = check_stages_per_rank(p, pp)
    if pp == 1:
        return
    stages = pp * v
    if not p.pp_split and stages > m.n_layer:
        what = f"pp x stages per rank = {pp} x {v} = {stages}" if v > 1 else f"{pp}"
        raise ConfigError(f"parallel.pp: {what} pipeline stages need at least as many layers, but "
                          f"model.n_layer={m.n_layer}; lower parallel.pp or raise model.n_layer")
    if p.pp_split and len(p.pp_split.split(",")) != stages - 1:
        raise ConfigError(f"parallel.pp_split: {stages} stages need {stages - 1} comma-separated split "
                          f"points, got {len(p.pp_split.split(','))}")
    mb = pp_microbatches(p, pp)
    dp = sizes["dp_replicate"] * sizes["dp_shard"]
    batch = r.global_batch // (dp * r.micro_batches)
    if batch % mb:
        raise ConfigError(f"parallel.pp_microbatches: {mb} does not divide the per-rank batch of "
                          f"run.global_batch / (data-parallel ranks x run.micro_batches) = "
                          f"{r.global_batch} / ({dp} x {r.micro_batches}) = {batch}; pick a divisor")
    check_microbatches(p, pp, mb)


def _validate_replica(cfg: Config) -> None:
    """fault.mode = "replica" supports replica groups of plain data parallelism (one process), of
    FSDP (dp_shard ranks, zero 2/3: HSDP across groups) or DiLoCo replicas (one process each);
    every other layout is refused here rather than trained with wrong parameters."""
    f, p = cfg.fault, cfg.parallel
    _check(f.mode in ("restart", "replica"), "fault.mode", "allowed: restart, replica", f.mode)
    _check(f.quorum_timeout_s > 0, "fault.quorum_timeout_s", "must be > 0", f.quorum_timeout_s)
    _check(f.min_groups >= 1, "fault.min_groups", "must be >= 1", f.min_groups)
    _check(0 <= f.spares <= 64, "fault.spares", "must be in [0, 64]", f.spares)
    if f.mode != "replica":
        return
    _check(not f.spares or (p.sync == "allreduce" and p.dp_shard == 1), "fault.spares", "spares "
           "replace groups of one data-parallel process (parallel.sync=allreduce, dp_shard=1) for now; "
           "set fault.spares=0", f.spares)
    if p.sync == "ps":  # every ps worker restarts alone (launch/psgroups.py); its checks: _validate_ps
        _check(cfg.ps.mode != "sync", "fault.mode", "replica needs ps.mode=async or ssp (sync mode "
               "waits for every worker each step); use fault.mode=restart", f.mode)
        return
    if p.zero != 0 if p.dp_shard == 1 else p.zero not in (2, 3):
        raise ConfigError(f"parallel.zero: {p.zero!r} is not supported with fault.mode=replica and "
                          f"parallel.dp_shard={p.dp_shard} yet; set parallel.zero=0 with dp_shard=1 "
                          f"(one process per group) or 2/3 with dp_shard > 1 (FSDP inside a group), "
                          f"or fault.mode=restart")
    diloco = p.sync == "diloco"  # groups are its replicas (one process each, for now)
    for name, value, plain in (("parallel.tp", p.tp, 1), ("parallel.pp", p.pp, 1),
                               ("parallel.sync", p.sync, "diloco" if diloco else "allreduce"),
                               ("sync.compress", cfg.sync.compress, "none"),
                               ("parallel.dp_shard", p.dp_shard, 1 if diloco else p.dp_shard),
                               ("sync.outer_compress", cfg.sync.outer_compress, "none"),
                               ("sync.sync_warmup_steps", cfg.sync.sync_warmup_steps, 0)):
        if value != plain:
            raise ConfigError(f"{name}: {value!r} is not supported with fault.mode=replica yet (replica "
                              f"groups are data-parallel, FSDP or DiLoCo replicas); set {name}={plain!r} or "
                              f"fault.mode=restart")


def replica_group_size(p: ParallelConfig, world_size: int) -> int:
    """Workers per replica group in replica mode: the dp_shard ranks that shard one replica."""
    return mesh_sizes(p, world_size)["dp_shard"]


def replica_group_config(cfg: Config) -> Config:
    """The config one replica group's world trains under: its own dp_shard ranks, no replicate
    dim (the groups meet in the quorum, sync/quorum.py, not in one mesh)."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_replicate=1))


def _validate_fault(f: FaultConfig) -> None:
    _check(f.max_restarts >= 0, "fault.max_restarts", "must be >= 0", f.max_restarts)
    _check(f.backoff_s >= 0, "fault.backoff_s", "must be >= 0", f.backoff_s)
    _check(f.hang_timeout_s >= 0, "fault.hang_timeout_s", "must be >= 0 (0 disables)", f.hang_timeout_s)
    _check(f.nonfinite in ("skip", "rollback", "stop"), "fault.nonfinite",
           "allowed: skip, rollback, stop", f.nonfinite)
    _check(f.max_nonfinite >= 1, "fault.max_nonfinite", "must be >= 1", f.max_nonfinite)
    _check(f.node_timeout_s >= 3, "fault.node_timeout_s", "must be >= 3 (3 keep-alives of >= 1 s)",
           f.node_timeout_s)
    _check(f.rdzv_last_call_s > 0, "fault.rdzv_last_call_s", "must be > 0", f.rdzv_last_call_s)
    _check(f.rdzv_join_timeout_s > 0, "fault.rdzv_join_timeout_s", "must be > 0", f.rdzv_join_timeout_s)
    # Here, not at the top, for start-up time: faults.py imports torch, and `allhands --help`
    # and `config show` validate without it. The spec's grammar lives with the injector.
    from allhands.faults import parse_faults

    parse_faults(f.inject)

SYNC_MODES = ("allreduce", "diloco", "local_sgd", "auto", "ps")
PS_MODES = ("sync", "async", "ssp")


def _validate_sync(cfg: Config) -> None:
    s, p, r, c = cfg.sync, cfg.parallel, cfg.run, cfg.checkpoint
    _check(s.compress in ("none", "fp16", "bf16", "powersgd"), "sync.compress",
           "allowed: none, fp16, bf16, powersgd", s.compress)
    if s.compress != "none":
        _check(p.sync in ("allreduce", "auto"), "sync.compress",
               f"compresses allreduce gradients; parallel.sync={p.sync!r} has none (use "
               f"sync.outer_compress)", s.compress)
    _check(s.powersgd_rank >= 1, "sync.powersgd_rank", "must be >= 1", s.powersgd_rank)
    _check(s.powersgd_start_step >= 1, "sync.powersgd_start_step", "must be >= 1", s.powersgd_start_step)
    _check(s.inner_steps >= 1, "sync.inner_steps", "must be >= 1", s.inner_steps)
    _check(s.outer_lr > 0, "sync.outer_lr", "must be > 0", s.outer_lr)
    _check(0.0 <= s.outer_momentum < 1.0, "sync.outer_momentum", "must be in [0, 1)", s.outer_momentum)
    _check(s.outer_compress in ("none", "fp16", "bf16", "int8"), "sync.outer_compress",
           "allowed: none, fp16, bf16, int8", s.outer_compress)
    _check(s.sync_warmup_steps >= 0, "sync.sync_warmup_steps", "must be >= 0", s.sync_warmup_steps)
    _check(s.auto_max_comm_s > 0, "sync.auto_max_comm_s", "must be > 0", s.auto_max_comm_s)
    if p.sync in ("diloco", "local_sgd", "auto"):
        # Inside a replica: DDP (zero 0) or FSDP over dp_shard (zero 2/3); the outer sync runs on
        # each rank's shard. ZeRO-1's optimizer-state partition is not reconciled per replica, and
        # tp/pp shards would need the outer sync per model-parallel coordinate: not built.
        for dim in ("pp", "tp"):
            if getattr(p, dim) != 1:
                raise ConfigError(f"parallel.{dim}: {getattr(p, dim)} is not supported with parallel.sync="
                                  f"{p.sync}; set parallel.{dim}=1 (inside a replica use parallel.zero=2 "
                                  f"or 3 to shard over dp_shard) or parallel.sync=allreduce")
        if p.zero == 1:
            raise ConfigError(f"parallel.zero: 1 (ZeroRedundancyOptimizer) is not supported with "
                              f"parallel.sync={p.sync}; use parallel.zero=2 (FSDP over dp_shard: "
                              f"optimizer state and gradients sharded) or 3 (parameters too), or 0 (DDP)")
    if p.sync == "ps":
        _validate_ps(cfg)
    if s.compress != "none" and p.zero >= 2:
        raise ConfigError(f"sync.compress: {s.compress} is a DDP communication hook; parallel.zero={p.zero} "
                          f"runs FSDP, which takes none; use parallel.zero 0 or 1, or sync.compress=none")
    if p.sync in ("diloco", "local_sgd", "auto"):
        # Between outer syncs the replicas differ: a checkpoint would keep one replica's model
        # (DCP deduplicates replicated tensors) and an eval would mix replicas, so both happen
        # only at sync points. The last step always syncs.
        h = s.inner_steps
        _check(c.interval % h == 0, "checkpoint.interval",
               f"must be a multiple of sync.inner_steps={h} with parallel.sync={p.sync}", c.interval)
        _check(r.eval_interval % h == 0, "run.eval_interval",
               f"must be a multiple of sync.inner_steps={h} with parallel.sync={p.sync}", r.eval_interval)




def _validate_ps(cfg: Config) -> None:
    q, p = cfg.ps, cfg.parallel
    _check(q.servers >= 1, "ps.servers", "must be >= 1", q.servers)
    _check(q.mode in PS_MODES, "ps.mode", "allowed: " + ", ".join(PS_MODES), q.mode)
    _check(q.max_staleness >= 0, "ps.max_staleness", "must be >= 0", q.max_staleness)
    for name in ("push_every", "fetch_every"):
        v = getattr(q, name)
        _check(v >= 1, f"ps.{name}", "must be >= 1", v)
        _check(v == 1 or q.mode != "sync", f"ps.{name}", "must be 1 with ps.mode=sync (every step "
               "aggregates every worker's gradient); use ps.mode=async or ssp", v)
    _check(q.lr >= 0, "ps.lr", "must be >= 0 (0 = optim.lr)", q.lr)
    _check(bool(q.optimizer), "ps.optimizer", "must be auto or a torch.optim class name", q.optimizer)
    _check(bool(q.sparse.strip()), "ps.sparse", "must be auto, none or parameter names", q.sparse)
    _check(q.row_init_std >= 0, "ps.row_init_std", "must be >= 0", q.row_init_std)
    # The servers hold the whole model as flat pieces and workers whole replicas: data
    # parallelism only.
    for dim in ("pp", "tp", "dp_shard"):
        if getattr(p, dim) != 1:
            raise ConfigError(f"parallel.{dim}: {getattr(p, dim)} is not supported with parallel.sync=ps "
                              f"(servers shard the parameters, workers hold replicas); set parallel.{dim}=1")
    if p.zero != 0:
        raise ConfigError(f"parallel.zero: {p.zero} is not supported with parallel.sync=ps (the servers "
                          f"hold the optimizer state); set parallel.zero=0")
