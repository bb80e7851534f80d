"""Checks of the parallel section: the mesh's dims multiply to the world size, ZeRO has
something to shard, and tensor/pipeline layouts fit the model and the batch."""

from __future__ import annotations

from allhands.config.check import check
from allhands.config.pipeline import (PP_SCHEDULES, check_microbatches, check_stages_per_rank,
                                      pp_microbatches)
from allhands.config.tree import Config, ParallelConfig
from allhands.errors import ConfigError


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def check_dims(p: ParallelConfig) -> None:
    for dim in MESH_DIMS:
        v = getattr(p, dim)
        check(v == -1 or v >= 1, f"parallel.{dim}", "must be -1 (the rest of the workers) or >= 1", v)
    rest = [d for d in MESH_DIMS if getattr(p, d) == -1]
    if len(rest) > 1:
        raise ConfigError(f"parallel.{rest[1]}: only one mesh dim may be -1 (the rest of the workers), "
                          f"but {' and '.join('parallel.' + d for d in rest)} are; set all but one")


def check_parallel(p: ParallelConfig) -> None:
    """Checks of the parallel section that need no world size."""
    check_dims(p)
    check(p.zero in (0, 1, 2, 3), "parallel.zero", "allowed: 0 (DDP), 1, 2, 3", p.zero)
    check(p.ac in ("none", "block", "selective"), "parallel.ac", "allowed: none, block, selective", p.ac)
    check(p.reduce_dtype in ("fp32", "bf16"), "parallel.reduce_dtype", "allowed: fp32, bf16",
           p.reduce_dtype)
    if p.dp_shard not in (1, -1) and p.zero == 0 and p.sync not in ("diloco", "local_sgd"):
        raise ConfigError(f"parallel.zero: 0 (plain DDP) replicates everything, but parallel.dp_shard="
                          f"{p.dp_shard} asks to shard; set parallel.zero to 1, 2 or 3, or dp_shard=1")
    check(p.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", f"allowed: {', '.join(PP_SCHEDULES)}",
           p.pp_schedule)
    check(p.pp_microbatches >= 0, "parallel.pp_microbatches", "must be >= 0 (0 = one per stage)",
           p.pp_microbatches)
    check(p.pp_stages_per_rank >= 0, "parallel.pp_stages_per_rank", "must be >= 0 (0 = automatic)",
           p.pp_stages_per_rank)


def mesh_sizes(p: ParallelConfig, world_size: int) -> dict[str, int]:
    """The mesh sizes for ``world_size`` workers, the one -1 resolved; raises ConfigError
    with the arithmetic when they do not multiply to the world size."""
    check_dims(p)
    given = {d: getattr(p, d) for d in MESH_DIMS}
    fixed = 1
    for v in given.values():
        fixed *= v if v != -1 else 1
    shown = " x ".join(f"{d}={v}" for d, v in (("dp_replicate", p.dp_replicate),
                                                  ("dp_shard", p.dp_shard),
                                                  *((("cp", p.cp),) if p.cp != 1 else ()),
                                                  ("tp", p.tp), ("pp", p.pp)))
    rest = [d for d, v in given.items() if v == -1]
    if rest:
        if world_size % fixed:
            raise ConfigError(f"parallel: {shown}: the fixed dims multiply to {fixed}, which does not "
                              f"divide the job's {world_size} workers; " +
                              (_cp_fix(p, world_size) or "change the sizes or the worker count"))
        given[rest[0]] = world_size // fixed
    elif fixed != world_size:
        raise ConfigError(f"parallel: {shown} = {fixed}, but the job has {world_size} workers; " +
                          (_cp_fix(p, world_size) or _ep_fix(p, world_size)
                           or f"make the product {world_size} or set one dim to -1"))
    if given["cp"] == 1:  # context parallelism is named only where it is used
        del given["cp"]
    return given


def _ep_fix(p: ParallelConfig, world_size: int) -> str:
    """The fix of a wrong product when ``parallel.ep`` is set: ep is no factor of it, because
    expert parallelism borrows the data-parallel ranks (torchtitan's layout; mesh.py)."""
    if p.ep <= 1:
        return ""
    dim, other = (("dp_shard", p.dp_replicate) if p.zero >= 2  # ZeRO 2/3 carve ep out of dp_shard
                  else ("dp_replicate", p.dp_shard))
    model = p.cp * p.tp * p.pp  # ranks per data-parallel rank
    dp = world_size // model
    size = dp // other
    if -1 in (p.dp_replicate, p.dp_shard, p.tp, p.pp) or world_size % model or dp % other \
            or (size if p.zero >= 2 else dp) % p.ep:
        fix = (f"make parallel.{dim} a multiple of {p.ep} (on a multiple of "
               f"{p.ep * model * (other if p.zero >= 2 else 1)} workers) or lower parallel.ep")
    else:
        fix = f"set parallel.{dim}={size}"
    return (f"parallel.ep={p.ep} adds no ranks (expert parallelism borrows the data-parallel ranks, "
            f"dp_replicate x dp_shard, which ep must divide): {fix}")


def _cp_fix(p: ParallelConfig, world_size: int) -> str:
    """The fix of a wrong product when ``parallel.cp`` is set: unlike ep, cp is a factor of it."""
    if p.cp <= 1:
        return ""
    model = p.cp * p.tp * p.pp  # ranks per data-parallel rank
    dp = world_size // model
    if -1 in (p.dp_replicate, p.dp_shard, p.tp, p.pp) or world_size % model or dp % p.dp_shard:
        fix = (f"run a multiple of {model} workers"
               f"{' with parallel.dp_replicate=-1' if -1 not in (p.dp_replicate, p.dp_shard, p.tp, p.pp) else ''}"
               f" or lower parallel.cp")
    else:
        fix = f"set parallel.dp_replicate={dp // p.dp_shard}"
    return (f"parallel.cp={p.cp} takes ranks of its own (context parallelism splits each data-parallel "
            f"rank's sequences over cp more ranks, borrowing none): {fix}")


def check_sharding(p: ParallelConfig, sizes: dict[str, int]) -> None:
    """Layout rules that need the resolved sizes."""
    if p.zero > 0 and sizes["dp_shard"] == 1 and sizes["dp_replicate"] > 1:
        raise ConfigError(f"parallel.zero: {p.zero} shards over parallel.dp_shard, which is 1 here, so "
                          f"nothing would be sharded; set parallel.dp_shard (e.g. -1 with "
                          f"parallel.dp_replicate=1) or parallel.zero=0")


def check_tp_pp(cfg: Config, sizes: dict[str, int]) -> None:
    """Tensor/pipeline layouts the reference model and the batch cannot honour, caught before
    start instead of as a shape error or a hang inside a collective."""
    m, p, r = cfg.model, cfg.parallel, cfg.run
    tp, pp, cp = sizes["tp"], sizes["pp"], sizes.get("cp", 1)
    if cp > 1:
        check_cp(cfg, cp, tp, pp)
    if tp > 1:
        if tp > m.n_head:
            raise ConfigError(f"parallel.tp: {tp} is larger than model.n_head={m.n_head}; every tensor-"
                              f"parallel rank needs at least one attention head, use tp <= {m.n_head}")
        if m.n_head % tp:
            raise ConfigError(f"parallel.tp: {tp} does not divide model.n_head={m.n_head}; heads are split "
                              f"evenly over tp ranks, use a divisor of {m.n_head}")
        kv = m.n_kv_head or m.n_head
        if m.family == "llama" and kv % tp:
            # each tp rank holds whole key/value heads with their query groups (parallel/tensor.py)
            raise ConfigError(f"parallel.tp: {tp} does not divide model.n_kv_head={kv}; key/value heads are "
                              f"split evenly over tp ranks, use a divisor of {kv}")
        if p.zero < 2 and sizes["dp_replicate"] * sizes["dp_shard"] * cp > 1:
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


def check_cp(cfg: Config, cp: int, tp: int, pp: int) -> None:
    """Context parallelism cuts every sequence into 2 x cp chunks (parallel/context.py) and
    masks attention over the gathered keys: the Llama family, no pipeline stages, lock-step."""
    m, p = cfg.model, cfg.parallel
    if m.family != "llama":
        raise ConfigError(f"parallel.cp: {cp} needs model.family=llama (its attention takes the "
                          f"positions and masks context parallelism gives it); got {m.family!r}")
    if pp > 1:
        raise ConfigError(f"parallel.cp: {cp} does not run with pipeline stages (parallel.pp={pp}) "
                          f"yet; set one of them to 1")
    if p.sync not in ("allreduce", "auto"):
        raise ConfigError(f"parallel.cp: {cp} needs parallel.sync=allreduce (its ranks reduce one "
                          f"gradient every step); got {p.sync!r}")
    chunk = 2 * cp * (tp if p.tp_sequence_parallel and tp > 1 else 1)
    if m.seq_len % chunk:
        raise ConfigError(f"parallel.cp: {cp} cuts model.seq_len={m.seq_len} into 2 x cp"
                          f"{' x tp' if chunk != 2 * cp else ''} = {chunk} equal chunks; use a "
                          f"seq_len divisible by {chunk}")
