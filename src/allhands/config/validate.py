"""Validating the config tree before any worker starts: every problem is a ConfigError whose
message starts with the dotted path of the field and says what is allowed.

One module per part of the tree: this one the optimizer, run, checkpoint, log and data
sections and the order of the checks; validate_model.py the model section; layout_checks.py the
parallel section (mesh, ZeRO, tp, pp); mode_checks.py the sync, ps and fault sections (how replicas reconcile, and recover)."""

from __future__ import annotations

import json
from pathlib import Path

from allhands.config.check import check
from allhands.config.layout_checks import check_parallel, check_sharding, check_tp_pp, mesh_sizes
from allhands.config.moe import check_ep, validate_moe
from allhands.config.mode_checks import SYNC_MODES, check_fault, check_replica, check_sync
from allhands.config.tree import COMPILE_BACKENDS, TRACKERS, Config
from allhands.config.validate_model import validate_model
from allhands.errors import ConfigError


def validate(cfg: Config, world_size: int | None = None, need_data: bool = True) -> None:
    """Raise ConfigError for the first impossible value. ``world_size`` enables batch checks."""
    m, o, r, p, c, lg, d = cfg.model, cfg.optim, cfg.run, cfg.parallel, cfg.checkpoint, cfg.log, cfg.data
    validate_model(m)
    validate_moe(cfg.moe, m.family)
    check(o.lr > 0, "optim.lr", "must be > 0", o.lr)
    check(0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio", "must be in [0, 1]", o.min_lr_ratio)
    check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0", o.warmup_steps)
    check(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0", o.weight_decay)
    check(0.0 <= o.beta1 < 1.0, "optim.beta1", "must be in [0, 1)", o.beta1)
    check(0.0 <= o.beta2 < 1.0, "optim.beta2", "must be in [0, 1)", o.beta2)
    check(o.eps > 0, "optim.eps", "must be > 0", o.eps)
    check(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)", o.grad_clip)
    check(o.name in ("adamw", "sgd", "muon"), "optim.name", "allowed: adamw, sgd, muon", o.name)
    check(0.0 <= o.muon_momentum < 1.0, "optim.muon_momentum", "must be in [0, 1)", o.muon_momentum)
    check(1 <= o.muon_ns_steps <= 99, "optim.muon_ns_steps", "must be in [1, 99]", o.muon_ns_steps)
    check(o.muon_ns_dtype in ("auto", "float32", "bfloat16"), "optim.muon_ns_dtype",
          "allowed: auto, float32, bfloat16", o.muon_ns_dtype)
    check(p.sync in SYNC_MODES, "parallel.sync", "allowed: " + ", ".join(SYNC_MODES), p.sync)
    check_sync(cfg)
    check(p.backend in ("auto", "gloo", "nccl"), "parallel.backend", "allowed: auto, gloo, nccl", p.backend)
    check(p.bucket_mb > 0, "parallel.bucket_mb", "must be > 0", p.bucket_mb)
    check(p.timeout_s > 0, "parallel.timeout_s", "must be > 0", p.timeout_s)
    check_parallel(p)
    check(p.layout in ("manual", "auto"), "parallel.layout", "allowed: manual, auto", p.layout)
    check(p.memory_gib >= 0, "parallel.memory_gib", "must be >= 0 (0 = found at launch)", p.memory_gib)
    check_ep(p, cfg.moe)
    check(c.interval >= 0, "checkpoint.interval", "must be >= 0 (0 = only at the end)", c.interval)
    check(c.keep_last >= 1, "checkpoint.keep_last", "must be >= 1", c.keep_last)
    check(c.mode in ("async", "sync"), "checkpoint.mode", "allowed: async, sync", c.mode)
    check(0 <= c.max_overhead < 1, "checkpoint.max_overhead", "must be in [0, 1), e.g. 0.02", c.max_overhead)
    check_fault(cfg.fault)
    check_replica(cfg)
    check(lg.interval >= 1, "log.interval", "must be >= 1", lg.interval)
    for t in lg.trackers:
        check(t in TRACKERS, "log.trackers", "allowed: " + ", ".join(TRACKERS), t)
    check(lg.peak_tflops >= 0, "log.peak_tflops", "must be >= 0 (0 = the datasheet table or a "
          "measured CPU peak)", lg.peak_tflops)
    check(lg.progress_s >= 0, "log.progress_s", "must be >= 0 (0 disables the plain progress lines)",
           lg.progress_s)
    check(d.eval_batches >= 0, "data.eval_batches", "must be >= 0", d.eval_batches)
    check(d.packing in ("concat", "mask", "pad"), "data.packing", "allowed: concat, mask, pad", d.packing)
    if d.packing == "mask" and (m.family != "llama" or p.pp != 1):
        raise ConfigError(f"data.packing: 'mask' needs the Llama family's document masks without "
                          f"pipeline stages (a later stage sees no token ids to mask by); got "
                          f"model.family={m.family!r}, parallel.pp={p.pp}: set model.family=llama "
                          f"and parallel.pp=1, or data.packing=pad or concat")
    check(r.steps >= 1, "run.steps", "must be >= 1", r.steps)
    check(r.global_batch >= 1, "run.global_batch", "must be >= 1", r.global_batch)
    check(r.micro_batches >= 1, "run.micro_batches", "must be >= 1", r.micro_batches)
    check(r.eval_interval >= 0, "run.eval_interval", "must be >= 0", r.eval_interval)
    check(r.threads >= 0, "run.threads", "must be >= 0 (0 = cores / workers)", r.threads)
    check(r.device in ("auto", "cpu", "cuda"), "run.device", "allowed: auto, cpu, cuda", r.device)
    check(r.compile_backend in COMPILE_BACKENDS, "run.compile_backend",
          "allowed: " + ", ".join(COMPILE_BACKENDS), r.compile_backend)
    check(r.precision in ("auto", "fp32", "bf16"), "run.precision", "allowed: auto, fp32, bf16", r.precision)
    check(bool(r.name) and "/" not in r.name, "run.name", "must be non-empty and contain no '/'", r.name)
    if p.backend == "nccl" and r.device == "cpu":
        raise ConfigError("parallel.backend: 'nccl' needs run.device=cuda; use gloo or auto on CPU")
    if world_size is not None:
        if p.sync == "ps":
            check(world_size > cfg.ps.servers, "ps.servers",
                   f"must be fewer than the job's {world_size} ranks (the rest are workers)", cfg.ps.servers)
            world_size -= cfg.ps.servers  # the mesh spans the workers
        sizes = mesh_sizes(p, world_size)
        check_sharding(p, sizes)
        dp = sizes["dp_replicate"] * sizes["dp_shard"]
        per = dp * r.micro_batches
        check(r.global_batch % per == 0, "run.global_batch",
               f"must be divisible by data-parallel ranks x micro_batches = {dp} x {r.micro_batches} = {per}",
               r.global_batch)
        check_tp_pp(cfg, sizes)
        check_ep(p, cfg.moe, sizes)
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
