"""Checks of the sync, ps and fault sections: how replicas reconcile (all-reduce, DiLoCo, local
SGD, the parameter server) and how the job recovers (restart, replica groups, spares)."""

from __future__ import annotations

import dataclasses

from allhands.config.check import check
from allhands.config.layout_checks import mesh_sizes
from allhands.config.tree import Config, FaultConfig, ParallelConfig
from allhands.errors import ConfigError


def check_replica(cfg: Config) -> None:
    """fault.mode = "replica" supports replica groups of plain data parallelism (one process), of
    FSDP (dp_shard ranks, zero 2/3: HSDP across groups) or DiLoCo replicas (one process each);
    every other layout is refused here rather than trained with wrong parameters."""
    f, p = cfg.fault, cfg.parallel
    check(f.mode in ("restart", "replica"), "fault.mode", "allowed: restart, replica", f.mode)
    check(f.quorum_timeout_s > 0, "fault.quorum_timeout_s", "must be > 0", f.quorum_timeout_s)
    check(f.min_groups >= 1, "fault.min_groups", "must be >= 1", f.min_groups)
    check(0 <= f.spares <= 64, "fault.spares", "must be in [0, 64]", f.spares)
    if f.mode != "replica":
        return
    check(not f.spares or (p.sync == "allreduce" and p.dp_shard == 1), "fault.spares", "spares "
           "replace groups of one data-parallel process (parallel.sync=allreduce, dp_shard=1) for now; "
           "set fault.spares=0", f.spares)
    if p.sync == "ps":  # every ps worker restarts alone (launch/psgroups.py); its checks: _validate_ps
        check(cfg.ps.mode != "sync", "fault.mode", "replica needs ps.mode=async or ssp (sync mode "
               "waits for every worker each step); use fault.mode=restart", f.mode)
        return
    if p.zero != 0 if p.dp_shard == 1 else p.zero not in (2, 3):
        raise ConfigError(f"parallel.zero: {p.zero!r} is not supported with fault.mode=replica and "
                          f"parallel.dp_shard={p.dp_shard} yet; set parallel.zero=0 with dp_shard=1 "
                          f"(one process per group) or 2/3 with dp_shard > 1 (FSDP inside a group), "
                          f"or fault.mode=restart")
    diloco = p.sync == "diloco"  # groups are its replicas (one process each, for now)
    for name, value, plain in (("parallel.tp", p.tp, 1), ("parallel.pp", p.pp, 1), ("parallel.cp", p.cp, 1),
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
    dim (the groups meet in the quorum, replica/quorum.py, not in one mesh)."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_replicate=1))


def check_fault(f: FaultConfig) -> None:
    check(f.max_restarts >= 0, "fault.max_restarts", "must be >= 0", f.max_restarts)
    check(f.backoff_s >= 0, "fault.backoff_s", "must be >= 0", f.backoff_s)
    check(f.hang_timeout_s >= 0, "fault.hang_timeout_s", "must be >= 0 (0 disables)", f.hang_timeout_s)
    check(f.first_step_timeout_s >= 0, "fault.first_step_timeout_s", "must be >= 0 (0 = no limit)",
          f.first_step_timeout_s)
    check(f.nonfinite in ("skip", "rollback", "stop"), "fault.nonfinite",
           "allowed: skip, rollback, stop", f.nonfinite)
    check(f.max_nonfinite >= 1, "fault.max_nonfinite", "must be >= 1", f.max_nonfinite)
    check(f.node_timeout_s >= 3, "fault.node_timeout_s", "must be >= 3 (3 keep-alives of >= 1 s)",
           f.node_timeout_s)
    check(f.rdzv_last_call_s > 0, "fault.rdzv_last_call_s", "must be > 0", f.rdzv_last_call_s)
    check(f.rdzv_join_timeout_s > 0, "fault.rdzv_join_timeout_s", "must be > 0", f.rdzv_join_timeout_s)
    # Here, not at the top, for start-up time: faults.py imports torch, and `allhands --help`
    # and `config show` validate without it. The spec's grammar lives with the injector.
    from allhands.faults import parse_faults

    parse_faults(f.inject)

SYNC_MODES = ("allreduce", "diloco", "local_sgd", "auto", "ps")
PS_MODES = ("sync", "async", "ssp")


def check_sync(cfg: Config) -> None:
    s, p, r, c = cfg.sync, cfg.parallel, cfg.run, cfg.checkpoint
    check(s.compress in ("none", "fp16", "bf16", "powersgd"), "sync.compress",
           "allowed: none, fp16, bf16, powersgd", s.compress)
    if s.compress != "none":
        check(p.sync in ("allreduce", "auto"), "sync.compress",
               f"compresses allreduce gradients; parallel.sync={p.sync!r} has none (use "
               f"sync.outer_compress)", s.compress)
    check(s.powersgd_rank >= 1, "sync.powersgd_rank", "must be >= 1", s.powersgd_rank)
    check(s.powersgd_start_step >= 1, "sync.powersgd_start_step", "must be >= 1", s.powersgd_start_step)
    check(s.inner_steps >= 1, "sync.inner_steps", "must be >= 1", s.inner_steps)
    check(s.outer_lr > 0, "sync.outer_lr", "must be > 0", s.outer_lr)
    check(0.0 <= s.outer_momentum < 1.0, "sync.outer_momentum", "must be in [0, 1)", s.outer_momentum)
    check(s.outer_compress in ("none", "fp16", "bf16", "int8"), "sync.outer_compress",
           "allowed: none, fp16, bf16, int8", s.outer_compress)
    check(s.sync_warmup_steps >= 0, "sync.sync_warmup_steps", "must be >= 0", s.sync_warmup_steps)
    check(s.auto_max_comm_s > 0, "sync.auto_max_comm_s", "must be > 0", s.auto_max_comm_s)
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
        check_ps(cfg)
    if s.compress != "none" and p.zero >= 2:
        raise ConfigError(f"sync.compress: {s.compress} is a DDP communication hook; parallel.zero={p.zero} "
                          f"runs FSDP, which takes none; use parallel.zero 0 or 1, or sync.compress=none")
    if p.sync in ("diloco", "local_sgd", "auto"):
        # Between outer syncs the replicas differ: a checkpoint would keep one replica's model
        # (DCP deduplicates replicated tensors) and an eval would mix replicas, so both happen
        # only at sync points. The last step always syncs.
        h = s.inner_steps
        check(c.interval % h == 0, "checkpoint.interval",
               f"must be a multiple of sync.inner_steps={h} with parallel.sync={p.sync}", c.interval)
        check(r.eval_interval % h == 0, "run.eval_interval",
               f"must be a multiple of sync.inner_steps={h} with parallel.sync={p.sync}", r.eval_interval)




def check_ps(cfg: Config) -> None:
    q, p = cfg.ps, cfg.parallel
    check(q.servers >= 1, "ps.servers", "must be >= 1", q.servers)
    check(q.mode in PS_MODES, "ps.mode", "allowed: " + ", ".join(PS_MODES), q.mode)
    check(q.max_staleness >= 0, "ps.max_staleness", "must be >= 0", q.max_staleness)
    for name in ("push_every", "fetch_every"):
        v = getattr(q, name)
        check(v >= 1, f"ps.{name}", "must be >= 1", v)
        check(v == 1 or q.mode != "sync", f"ps.{name}", "must be 1 with ps.mode=sync (every step "
               "aggregates every worker's gradient); use ps.mode=async or ssp", v)
    check(q.lr >= 0, "ps.lr", "must be >= 0 (0 = optim.lr)", q.lr)
    check(bool(q.optimizer), "ps.optimizer", "must be auto or a torch.optim class name", q.optimizer)
    check(cfg.optim.name != "muon" or q.optimizer != "auto", "optim.name", "muon needs whole "
          "matrices, and the parameter servers step flat pieces of them: use optim.name=adamw or "
          "name a ps.optimizer", cfg.optim.name)
    check(bool(q.sparse.strip()), "ps.sparse", "must be auto, none or parameter names", q.sparse)
    check(q.row_init_std >= 0, "ps.row_init_std", "must be >= 0", q.row_init_std)
    # The servers hold the whole model as flat pieces and workers whole replicas: data
    # parallelism only.
    for dim in ("pp", "tp", "cp", "dp_shard"):
        if getattr(p, dim) != 1:
            raise ConfigError(f"parallel.{dim}: {getattr(p, dim)} is not supported with parallel.sync=ps "
                              f"(servers shard the parameters, workers hold replicas); set parallel.{dim}=1")
    if p.zero != 0:
        raise ConfigError(f"parallel.zero: {p.zero} is not supported with parallel.sync=ps (the servers "
                          f"hold the optimizer state); set parallel.zero=0")
