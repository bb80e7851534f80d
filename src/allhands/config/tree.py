"""The one typed config tree: defaults < TOML file < ``--set section.field=value``.

Every field carries a one-line doc in ``field(metadata={"doc": ...})`` so that
``allhands config show`` and docs/configuration.md can print it. This module holds the tree
and the merging of values into it; layering.py reads TOML files and ``--set`` items into it and
writes it back; validate.py checks the values.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from allhands.config.fields import _f
from allhands.config.moe import MoEConfig
from allhands.errors import ConfigError




@dataclass
class ModelConfig:
    """The decoder a run trains: the reference GPT or the Llama family (ignored when the Python
    API is given its own model; taken from config.json when checkpoint.init_from is a transformers
    directory)."""

    family: str = _f("gpt", "gpt (the reference GPT-2-style decoder) or llama (Llama 2/3, Mistral, Qwen2, Qwen3)")
    preset: str = _f("", "a named shape, e.g. llama3-8b, qwen3-0.6b (docs/models.md); it fills the "
                         "fields the TOML file and --set leave out (a field they set keeps its value, "
                         "even its default)")
    n_layer: int = _f(4, "number of transformer blocks")
    n_head: int = _f(4, "attention heads per block")
    n_embd: int = _f(128, "embedding width; must be divisible by n_head unless head_dim is set")
    n_kv_head: int = _f(0, "llama: key/value heads (grouped-query attention), dividing n_head; 0 = n_head")
    head_dim: int = _f(0, "llama: width of one attention head; 0 = n_embd / n_head")
    ffn_hidden: int = _f(0, "feed-forward width; 0 = 4 n_embd (gpt) or 8/3 n_embd rounded up to 64 (llama)")
    norm_eps: float = _f(1e-5, "epsilon of the layer norms (gpt) or RMSNorms (llama), > 0")
    activation: str = _f("gelu", "gpt: gelu (exact erf) or gelu_new (GPT-2's tanh approximation)")
    rope_theta: float = _f(10000.0, "llama: RoPE base frequency, > 0")
    rope_scaling: str = _f("", "llama: RoPE frequency scaling: empty (none) or llama3 (Llama 3.1+)")
    rope_factor: float = _f(8.0, "llama: llama3 scaling factor, > 0")
    rope_low_freq_factor: float = _f(1.0, "llama: llama3 scaling low_freq_factor, > 0")
    rope_high_freq_factor: float = _f(4.0, "llama: llama3 scaling high_freq_factor, > low_freq_factor")
    rope_original_seq_len: int = _f(8192, "llama: llama3 scaling original_max_position_embeddings, >= 1")
    qkv_bias: bool = _f(False, "llama: bias on the q, k and v projections (Qwen2)")
    qk_norm: bool = _f(False, "llama: RMSNorm over each query and key head (Qwen3)")
    max_positions: int = _f(0, "positions the model is meant for, written as config.json's "
                               "max_position_embeddings on export; 0 = seq_len")
    seq_len: int = _f(128, "context length in tokens (also the training sample length)")
    vocab_size: int = _f(0, "vocabulary size; 0 takes it from the dataset's tokenizer")
    dropout: float = _f(0.0, "gpt: dropout probability in attention and MLP, in [0, 1) (llama: 0)")
    bias: bool = _f(True, "gpt: use bias in linear layers and layer norms (llama: see qkv_bias)")
    tie_embeddings: bool = _f(True, "share the token embedding with the output head (GPT-2), also across pp stages")


@dataclass
class DataConfig:
    """Where training tokens come from and how samples are drawn."""

    path: str = _f("", "directory made by `allhands prepare`; empty uses the embedded corpus")
    mix: str = _f("", "several `allhands prepare` directories drawn by weight, DIR:WEIGHT[,DIR:WEIGHT...] "
                      "(same tokenizer; instead of data.path)")
    seed: int = _f(1234, "seed of the sample order; the order is independent of the worker count")
    eval_batches: int = _f(4, "global eval batches drawn from the held-out split per evaluation")
    packing: str = _f("concat", "how documents become rows: concat (windows of the token stream, "
                                "across documents), mask (whole documents packed into rows, "
                                "attention and positions kept inside each; model.family=llama), "
                                "pad (one document a row)")
    tokenizer_check: bool = _f(True, "stop a run whose checkpoint.init_from directory has a tokenizer.json "
                                     "that reads the prepared data's ids as other tokens; false trains anyway")


@dataclass
class OptimConfig:
    """AdamW (or Muon, or SGD) with linear warmup and cosine decay."""

    lr: float = _f(3e-3, "peak learning rate, > 0")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr, in [0, 1]")
    warmup_steps: int = _f(20, "linear warmup steps, >= 0")
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices (not on biases and norms), >= 0")
    beta1: float = _f(0.9, "AdamW beta1, in [0, 1)")
    beta2: float = _f(0.95, "AdamW beta2, in [0, 1)")
    eps: float = _f(1e-8, "AdamW epsilon, > 0")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this value; 0 disables")
    name: str = _f("adamw", "optimizer: adamw, sgd (plain SGD with lr and weight_decay; no momentum) or "
                   "muon (Muon on the hidden matrices, AdamW on the rest; docs/muon.md)")
    muon_momentum: float = _f(0.95, "muon: momentum of the matrices (Nesterov), in [0, 1)")
    muon_ns_steps: int = _f(5, "muon: Newton-Schulz iterations, in [1, 99]")
    muon_ns_dtype: str = _f("auto", "muon: Newton-Schulz dtype: auto (bfloat16 on CUDA, float32 on CPU), "
                            "float32 or bfloat16")
    muon_spread: bool = _f(True, "muon: each rank orthogonalizes a share of the matrices and sends the "
                           "results back; false: every rank orthogonalizes every matrix")


@dataclass
class ParallelConfig:
    """How the job is cut across processes."""

    dp_replicate: int = _f(-1, "data-parallel replicas; -1 = the rest of the workers (all of them by default)")
    sync: str = _f("allreduce", "how replicas reconcile: allreduce (every step), diloco, "
                   "local_sgd (both sync every sync.inner_steps over dp_replicate), ps (parameter servers: "
                   "see the ps section) or auto (measured; see docs/sync.md)")
    bucket_mb: float = _f(25.0, "DDP gradient bucket size in MiB, > 0")
    backend: str = _f("auto", "process-group backend: auto (nccl on CUDA, gloo on CPU), gloo or nccl")
    timeout_s: float = _f(300.0, "collective timeout in seconds, > 0")
    # The mesh is (pp, dp_replicate, dp_shard, cp, tp), outermost first (torchtitan's ParallelDims
    # order); the product of the sizes is the world size, and at most one of them is -1.
    dp_shard: int = _f(1, "data-parallel ranks that shard the training state (ZeRO/FSDP); -1 = the rest")
    tp: int = _f(1, "tensor-parallel degree; -1 = the rest of the workers")
    cp: int = _f(1, "context-parallel degree: each rank holds 1/cp of every sequence (the Llama "
                    "family; keys and values all-gathered per layer); -1 = the rest of the workers")
    pp: int = _f(1, "pipeline-parallel stages; -1 = the rest of the workers")
    zero: int = _f(0, "ZeRO stage over dp_shard: 0 DDP, 1 optimizer state, 2 +gradients, 3 +parameters")
    ac: str = _f("none", "activation checkpointing: none, block (every block) or selective (save matmuls)")
    reduce_dtype: str = _f("fp32", "gradient reduction dtype under zero 2/3 with run.precision=bf16: fp32 or bf16")
    # tensor and pipeline parallelism (parallel/tensor.py, parallel/pipeline.py)
    tp_sequence_parallel: bool = _f(True, "under tp, shard norms and residuals over the sequence (Korthikanti 2022)")
    pp_schedule: str = _f("1f1b", "pipeline schedule (torch's): gpipe, 1f1b, interleaved1f1b, loopedbfs, "
                          "interleavedzerobubble, zbvzerobubble or dualpipev")
    pp_microbatches: int = _f(0, "pipeline microbatches per step and data-parallel rank; 0 = one per stage")
    pp_stages_per_rank: int = _f(0, "pipeline stages per rank; 0 = 1 for gpipe and 1f1b, 2 for the others")
    pp_split: str = _f("", "comma-separated FQNs of the units beginning stages 1..; empty = the model's own")
    ep: int = _f(1, "expert-parallel degree: MoE experts split over this many data-parallel ranks "
                    "(parallel/expert.py); divides dp_shard under zero 2/3, else the data-parallel ranks")
    # choosing and checking the layout at launch (plan/auto.py; docs/layouts.md)
    layout: str = _f("manual", "manual (the fields above as set) or auto: at launch, the planner's fastest "
                               "layout that fits the devices found; fields set explicitly still win")
    memory_gib: float = _f(0.0, "memory of one rank that parallel.layout=auto and the memory check plan "
                                "for, in GiB; 0 = found at launch (the GPU's, or on CPU the host's / "
                                "workers on the node); >= 0")
    memory_check: bool = _f(True, "refuse, before any worker starts, a job whose predicted memory per rank "
                                  "exceeds a rank's memory; false starts it anyway")


@dataclass
class SyncConfig:
    """Options of the strategy chosen by parallel.sync: how replicas communicate less."""

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
class PSConfig:
    """parallel.sync = "ps": parameter servers (the last ``servers`` ranks) and workers (ps/client.py)."""

    servers: int = _f(1, "server processes, the job's last ranks; the other ranks are workers, >= 1")
    mode: str = _f("sync", "sync (every step averages all workers' gradients: DDP's update), async "
                   "(Downpour SGD) or ssp (async, bounded by max_staleness)")
    max_staleness: int = _f(2, "ssp: a worker more than this many steps ahead of the slowest waits, >= 0")
    push_every: int = _f(1, "async/ssp: push the summed gradients every this many steps, >= 1")
    fetch_every: int = _f(1, "async/ssp: pull fresh parameters every this many steps, >= 1")
    optimizer: str = _f("auto", "server optimizer: auto (the optim section's), or a torch.optim "
                        "class name, e.g. Adagrad (DistBelief's choice for async)")
    lr: float = _f(0.0, "server learning rate; 0 = optim.lr; the optim schedule scales it either way")
    sparse: str = _f("none", "embedding tables moved by row (the servers keep them: worker checkpoints "
                     "and export leave them out): none, auto (every nn.Embedding/EmbeddingBag weight "
                     "no other module uses) or comma-separated parameter names")
    row_init_std: float = _f(0.02, "a table built on the meta device starts from N(0, row_init_std), "
                             "drawn on the servers, >= 0")


@dataclass
class CheckpointConfig:
    """Distributed Checkpoint saves inside the run directory."""

    interval: int = _f(100, "save every this many steps; 0 saves only at the end")
    keep_last: int = _f(2, "committed checkpoints to keep, >= 1")
    at_end: bool = _f(True, "save a checkpoint after the last step")
    init_from: str = _f("", "start a new run from these weights: .safetensors from `allhands export`, or a "
                            "transformers directory, whose config.json then sets the model section")

    mode: str = _f("async", "async (only the copy to host memory blocks the step) or sync")
    max_overhead: float = _f(0.0, "0 = save every `interval` steps; > 0: save every smallest multiple "
                             "of `interval` steps whose measured save cost stays under this fraction "
                             "of the training time (CheckFreq), e.g. 0.02; in [0, 1)")


@dataclass
class FaultConfig:
    """Surviving failures: restarts, the hang watchdog, non-finite numbers, injected faults."""

    mode: str = _f("restart", "on a worker failure: restart (every worker, from the last checkpoint) or "
                              "replica (the other data-parallel replica groups carry on; see docs/faults.md)")
    max_restarts: int = _f(3, "restart all workers from the last checkpoint this many times, >= 0 "
                              "(0: a failed worker ends the job)")
    backoff_s: float = _f(1.0, "wait before a restart: backoff_s * 2**(k-1) after k failures in a row "
                                    "that completed no step, capped at 60 s; >= 0")
    hang_timeout_s: float = _f(180.0, "kill a worker with no step progress for this long; 0 disables")
    first_step_timeout_s: float = _f(1800.0, "the same limit for the first step of each (re)start, which "
                                             "builds caches and compiles (minutes for a large model under "
                                             "run.compile); at least hang_timeout_s; 0 = no limit")
    nonfinite: str = _f("skip", "on a NaN/Inf loss or gradient: skip (the update), rollback, or stop")
    max_nonfinite: int = _f(5, "stop after this many non-finite steps in a row, >= 1")
    inject: str = _f("", "deterministic faults RANK:STEP:KIND[,...]; KIND: a signal name, "
                         "exception, oom, hang, nan, ckpt (kill during the checkpoint write), heal-source|"
                         "heal-joiner (kill amid a replica-mode heal, as its source or as a joiner), ps-push (kill a "
                         "parameter-server worker halfway through a push), "
                         "flake (gloo's connectFullMesh error before the first step), slow=F "
                         "(from STEP on, every step F times as long: a straggler), launcher-SIGNAL "
                         "(the rank sends SIGNAL to its launcher during STEP: a stop at that step)")
    quorum_timeout_s: float = _f(1.0, "replica mode: how long a re-forming quorum waits for a group "
                                      "that does not answer (the survivors' stall after a failure), > 0")
    min_groups: int = _f(1, "replica mode: train only while at least this many replica groups are in the "
                            "quorum; with fewer, the survivors wait (in memory) for a replacement, >= 1")
    spares: int = _f(0, "replica mode: processes started beside the groups that wait, with torch "
                        "imported, to take a failed group's place within about a second; in [0, 64]")
    node_timeout_s: float = _f(15.0, "multi-node: a node whose agent sent no keep-alive for this long "
                                     "is dropped from the rendezvous (a lost host), >= 3")
    rdzv_last_call_s: float = _f(10.0, "multi-node --nnodes MIN:MAX: once MIN nodes joined a "
                                       "(re-)rendezvous, wait this long for more, > 0")
    rdzv_join_timeout_s: float = _f(900.0, "multi-node: a (re-)rendezvous with fewer than MIN nodes "
                                           "fails after this long (time for a host to come back), > 0")


TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The experiment trackers ``log.trackers`` may name (allhands/trackers.py)."""
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""The torch.compile backends ``run.compile_backend`` may name: the default and the two that tell
a compile problem from a generated kernel's (torchtitan's ``compile.backend`` offers the same)."""


@dataclass
class LogConfig:
    """What the run reports and where."""

    interval: int = _f(10, "write a metrics line every this many steps (and at the last), >= 1; "
                           "a logged step gathers every rank's record and reads it on the host, "
                           "the others read nothing back")
    progress: bool = _f(True, "report progress on rank 0: a bar on a terminal, else plain lines")
    progress_s: float = _f(30.0, "when the output is not a terminal (a log file, a pipe): a plain "
                                 "progress line every this many seconds, >= 0; 0 disables")
    tensorboard: bool = _f(True, "write TensorBoard events when tensorboard is installed; false leaves "
                                 "tensorboard out of log.trackers")
    trackers: list[str] = _f(["tensorboard"], "experiment trackers rank 0 logs to: tensorboard, wandb, "
                                              "mlflow (a TOML list, or NAME,NAME in --set)")
    peak_tflops: float = _f(0.0, "peak TFLOP/s of one device, which MFU is measured against; 0 = the "
                                 "datasheet table for a GPU (bf16 or fp32 as the run computes), a "
                                 "measured GEMM peak on CPU; >= 0")


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
    threads: int = _f(0, "torch intra-op threads per CPU worker; 0 = the cores the launcher may run on "
                       "(its CPU affinity: Slurm's or taskset's) / workers on the node")
    compile: bool = _f(False, "torch.compile each transformer block (after tensor parallelism and activation "
                       "checkpointing, before FSDP/DDP; under pp each stage's blocks)")
    compile_backend: str = _f("inductor", "run.compile's backend: inductor (generated kernels), or, to tell a "
                              "compile problem from a kernel one, aot_eager (the same graphs through "
                              "AOTAutograd, torch's own kernels, no code generated) or eager (dynamo only)")


@dataclass
class Config:
    """The root of the tree; each section is one component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    ps: PSConfig = field(default_factory=PSConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every field's value; the dict also carries which fields were given (:func:`given`),
        so that ``from_dict(to_dict())`` is an exact copy, one a preset still treats alike."""
        out = _ConfigDict(dataclasses.asdict(self))
        out.given = {sec.name: given(getattr(self, sec.name)) for sec in dataclasses.fields(self)}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        """The tree with ``d``'s values; each of them counts as given, as in a TOML file, except
        in a dict from :meth:`to_dict`, which says itself which were."""
        cfg = cls()
        _merge(cfg, d, "")
        record = getattr(d, "given", None)
        if record is not None:
            for name, names in record.items():
                getattr(cfg, name).__dict__[_GIVEN] = frozenset(names)
        return cfg


class _ConfigDict(dict):
    """A plain dict of values (JSON, comparisons and trackers see nothing else) with the record
    of given fields as an attribute, which pickling to a worker keeps."""

    given: dict[str, frozenset[str]]


# --------------------------------------------------------------------------- given fields

_GIVEN = "_allhands_given"


def given(section: Any) -> frozenset[str]:
    """The fields of ``section`` that a TOML file, ``--set`` or a dict gave a value, whatever the
    value: a preset leaves them alone. A section built in Python keeps no record (empty)."""
    return section.__dict__.get(_GIVEN, frozenset())


def mark_given(section: Any, names: Any) -> None:
    """Record ``names`` as given in ``section`` (a resolved section: every field is final)."""
    section.__dict__[_GIVEN] = given(section) | frozenset(names)


# --------------------------------------------------------------------------- merging

_SCALARS = (bool, int, float, str)


def _type_of(section: Any, name: str) -> type:
    hints = typing.get_type_hints(type(section))
    t = hints[name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:  # pragma: no cover
        raise TypeError(f"config field {name} must have one scalar type")
    return t


def _coerce(value: Any, t: type, path: str) -> Any:
    """Check a TOML value against the field type; ints are accepted for floats, and a list of
    strings is also accepted as one comma-separated string (``--set log.trackers=wandb,mlflow``)."""
    if typing.get_origin(t) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ConfigError(f"{path}: expected a list of strings, got {type(value).__name__} {value!r}")
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
            mark_given(node, (key,))
