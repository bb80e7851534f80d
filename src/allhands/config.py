"""The one typed config tree: defaults < TOML file < ``--set section.field=value``.

Every field carries a one-line doc in ``field(metadata={"doc": ...})`` so that
``allhands config show`` and the docs can print it. Validation runs in the launcher,
before any worker starts; every problem is a :class:`ConfigError` whose message starts
with the dotted path of the field and says what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from allhands.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib




def _f(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)


@dataclass
class ModelConfig:
    """The reference GPT decoder (ignored when the Python API is given its own model)."""

    n_layer: int = _f(4, "number of transformer blocks")
    n_head: int = _f(4, "attention heads per block")
    n_embd: int = _f(128, "embedding width; must be divisible by n_head")
    seq_len: int = _f(128, "context length in tokens (also the training sample length)")
    vocab_size: int = _f(0, "vocabulary size; 0 takes it from the dataset's tokenizer")
    dropout: float = _f(0.0, "dropout probability in attention and MLP, in [0, 1)")
    bias: bool = _f(True, "use bias in linear layers and layer norms")


@dataclass
class DataConfig:
    """Where training tokens come from and how samples are drawn."""

    path: str = _f("", "directory made by `allhands prepare`; empty uses the embedded corpus")
    seed: int = _f(1234, "seed of the sample order; the order is independent of the worker count")
    eval_batches: int = _f(4, "global eval batches drawn from the held-out split per evaluation")


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = _f(3e-3, "peak learning rate, > 0")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr, in [0, 1]")
    warmup_steps: int = _f(20, "linear warmup steps, >= 0")
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices (not on biases and norms), >= 0")
    beta1: float = _f(0.9, "AdamW beta1, in [0, 1)")
    beta2: float = _f(0.95, "AdamW beta2, in [0, 1)")
    eps: float = _f(1e-8, "AdamW epsilon, > 0")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this value; 0 disables")
    name: str = _f("adamw", "optimizer: adamw, or sgd (plain SGD with lr and weight_decay; no momentum)")


@dataclass
class ParallelConfig:
    """How the job is cut across processes."""

    dp_replicate: int = _f(-1, "data-parallel replicas; -1 uses every worker")
    sync: str = _f("allreduce", "how replicas reconcile: allreduce (DDP every step), diloco, "
                   "local_sgd (both sync every sync.inner_steps) or auto (measured; see README)")
    bucket_mb: float = _f(25.0, "DDP gradient bucket size in MiB, > 0")
    backend: str = _f("auto", "process-group backend: auto (nccl on CUDA, gloo on CPU), gloo or nccl")
    timeout_s: float = _f(300.0, "collective timeout in seconds, > 0")


@dataclass
class SyncConfig:
    """Options of the strategy chosen by parallel.sync (issue 5: communicating less)."""

    compress: str = _f("none", "allreduce gradient compression: none, fp16, bf16 or powersgd")
    powersgd_rank: int = _f(4, "PowerSGD matrix approximation rank, >= 1")
    powersgd_start_step: int = _f(10, "PowerSGD: plain all-reduce for this many steps first, >= 1")
    inner_steps: int = _f(50, "diloco/local_sgd: local steps H between outer syncs, >= 1")
    outer_lr: float = _f(0.7, "diloco: outer learning rate (DiLoCo paper: 0.7), > 0")
    outer_momentum: float = _f(0.9, "diloco: outer SGD momentum (paper: 0.9), in [0, 1)")
    outer_nesterov: bool = _f(True, "diloco: Nesterov outer momentum (paper: true)")
    outer_compress: str = _f("none", "diloco/local_sgd outer sync payload: none, fp16, bf16 or int8")
    auto_max_comm_s: float = _f(0.05, "auto: choose diloco when one gradient all-reduce is "
                                "predicted to take longer than this (seconds), > 0")
    sync_warmup_steps: int = _f(0, "diloco/local_sgd: synchronous data-parallel steps before the "
                                "first round (post-local SGD), >= 0")


@dataclass
class CheckpointConfig:
    """Distributed Checkpoint saves inside the run directory."""

    interval: int = _f(100, "save every this many steps; 0 saves only at the end")
    keep_last: int = _f(2, "committed checkpoints to keep, >= 1")
    at_end: bool = _f(True, "save a checkpoint after the last step")


@dataclass
class LogConfig:
    """What the run reports and where."""

    interval: int = _f(1, "write a metrics line every this many steps, >= 1")
    progress: bool = _f(True, "show a progress bar on rank 0")
    tensorboard: bool = _f(True, "write TensorBoard events when tensorboard is installed")


@dataclass
class RunConfig:
    """The job as a whole."""

    name: str = _f("default", "job name, used in the run directory's name")
    dir: str = _f("", "run directory; empty makes runs/<name>-<timestamp>")
    steps: int = _f(300, "optimizer steps to train, >= 1")
    global_batch: int = _f(32, "samples per optimizer step over all workers")
    micro_batches: int = _f(1, "gradient-accumulation micro-batches per worker per step, >= 1")
    eval_interval: int = _f(50, "evaluate every this many steps; 0 evaluates only at start and end")
    seed: int = _f(0, "seed of model initialisation and of every per-rank RNG")
    device: str = _f("auto", "auto (cuda when available, else cpu), cpu or cuda")
    precision: str = _f("auto", "auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16")
    check_sync: bool = _f(False, "debug: compare a parameter checksum across ranks after each update")
    threads: int = _f(0, "torch intra-op threads per CPU worker; 0 = CPU cores / workers on the node")


@dataclass
class Config:
    """The root of the tree; each section is one component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        cfg = cls()
        _merge(cfg, d, "")
        return cfg


# --------------------------------------------------------------------------- merging

_SCALARS = (bool, int, float, str)


def _type_of(section: Any, name: str) -> type:
    hints = typing.get_type_hints(type(section))
    t = hints[name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:  # pragma: no cover
        raise TypeError(f"config field {name} must have one scalar type")
    return t


def _coerce(value: Any, t: type, path: str) -> Any:
    """Check a TOML value against the field type; ints are accepted for floats."""
    if t is bool:
        if isinstance(value, bool):
            return value
    elif t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif t is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif t is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{path}: expected {t.__name__}, got {type(value).__name__} {value!r}")


def _merge(node: Any, d: Any, prefix: str) -> None:
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table, got {d!r}")
    known = {f.name: f for f in dataclasses.fields(node)}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if key not in known:
            allowed = ", ".join(sorted(known))
            raise ConfigError(f"{path}: unknown key; allowed here: {allowed}")
        current = getattr(node, key)
        if dataclasses.is_dataclass(current):
            _merge(current, value, path + ".")
        else:
            setattr(node, key, _coerce(value, _type_of(node, key), path))


def _parse_literal(raw: str) -> Any:
    """Parse the right-hand side of ``--set`` as a TOML value, else take it as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_override(cfg: Config, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.field=value, e.g. optim.lr=3e-4")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: the key must be section.field, e.g. optim.lr")
    section, name = parts
    value = _parse_literal(raw.strip())
    # A string field keeps exactly what was typed (a run name "1e3" stays a string).
    node = getattr(cfg, section, None)
    if dataclasses.is_dataclass(node) and name in {f.name for f in dataclasses.fields(node)}:
        if _type_of(node, name) is str and not isinstance(value, str):
            value = raw.strip()
    _merge(cfg, {section: {name: value}}, "")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults < TOML file < overrides, then validated. Raises ConfigError."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing TOML file")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        _merge(cfg, data, "")
    for item in overrides:
        apply_override(cfg, item)
    return cfg


# --------------------------------------------------------------------------- validation


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
    _check(p.dp_replicate == -1 or p.dp_replicate >= 1, "parallel.dp_replicate",
           "must be -1 (all workers) or >= 1", p.dp_replicate)
    _check(c.interval >= 0, "checkpoint.interval", "must be >= 0 (0 = only at the end)", c.interval)
    _check(c.keep_last >= 1, "checkpoint.keep_last", "must be >= 1", c.keep_last)
    _check(lg.interval >= 1, "log.interval", "must be >= 1", lg.interval)
    _check(d.eval_batches >= 0, "data.eval_batches", "must be >= 0", d.eval_batches)
    _check(r.steps >= 1, "run.steps", "must be >= 1", r.steps)
    _check(r.global_batch >= 1, "run.global_batch", "must be >= 1", r.global_batch)
    _check(r.micro_batches >= 1, "run.micro_batches", "must be >= 1", r.micro_batches)
    _check(r.eval_interval >= 0, "run.eval_interval", "must be >= 0", r.eval_interval)
    _check(r.threads >= 0, "run.threads", "must be >= 0 (0 = cores / workers)", r.threads)
    _check(r.device in ("auto", "cpu", "cuda"), "run.device", "allowed: auto, cpu, cuda", r.device)
    _check(r.precision in ("auto", "fp32", "bf16"), "run.precision", "allowed: auto, fp32, bf16", r.precision)
    _check(bool(r.name) and "/" not in r.name, "run.name", "must be non-empty and contain no '/'", r.name)
    if p.backend == "nccl" and r.device == "cpu":
        raise ConfigError("parallel.backend: 'nccl' needs run.device=cuda; use gloo or auto on CPU")
    if world_size is not None:
        dp = world_size if p.dp_replicate == -1 else p.dp_replicate
        _check(dp == world_size, "parallel.dp_replicate",
               f"must equal the worker count {world_size} (or -1) until other mesh dims exist", p.dp_replicate)
        per = dp * r.micro_batches
        _check(r.global_batch % per == 0, "run.global_batch",
               f"must be divisible by workers x micro_batches = {dp} x {r.micro_batches} = {per}",
               r.global_batch)
    if need_data and d.path:
        path = Path(d.path)
        if not (path / "meta.json").is_file():
            raise ConfigError(f"data.path: {d.path!r} has no meta.json; make it with "
                              f"`allhands prepare TEXT_FILES --out {d.path}` or leave data.path empty")


SYNC_MODES = ("allreduce", "diloco", "local_sgd", "auto")


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
        # Between outer syncs the replicas differ: a checkpoint would keep one replica's model
        # (DCP deduplicates replicated tensors) and an eval would mix replicas, so both happen
        # only at sync points. The last step always syncs.
        h = s.inner_steps
        _check(c.interval % h == 0, "checkpoint.interval",
               f"must be a multiple of sync.inner_steps={h} with parallel.sync={p.sync}", c.interval)
        _check(r.eval_interval % h == 0, "run.eval_interval",
               f"must be a multiple of sync.inner_steps={h} with parallel.sync={p.sync}", r.eval_interval)


# --------------------------------------------------------------------------- output


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'


def to_toml(cfg: Config, with_docs: bool = False) -> str:
    """Render the tree as TOML that :func:`load_config` reads back to an equal Config."""
    out: list[str] = []
    for sec in dataclasses.fields(cfg):
        node = getattr(cfg, sec.name)
        if out:
            out.append("")
        out.append(f"[{sec.name}]")
        for f in dataclasses.fields(node):
            line = f"{f.name} = {_toml_value(getattr(node, f.name))}"
            if with_docs:
                line = f"{line:<34} # {f.metadata.get('doc', '')}"
            out.append(line)
    return "\n".join(out) + "\n"
