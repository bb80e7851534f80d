"""The one training loop. It runs inside each worker process and does not know which sync
strategy, model or dataset it was given.

Per step: this rank's micro-batches of the global batch (sampler.py) -> forward/backward, with
the strategy deciding where gradients are reconciled -> clip -> AdamW step -> schedule step ->
metrics -> maybe eval -> maybe checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from allhands.checkpoint import (Cadence, Checkpointer, ModelOptimState, RNGState, TrainState,
                                 check_compatible, load_weights, seed_rank)
from allhands.config import Config, pp_microbatches, pp_stages_per_rank
from allhands.data import GlobalSampler, load_token_splits
from allhands.data.sampler import collate
from allhands.errors import CheckpointError, ConfigError
from allhands.faults import FaultInjector, NonFiniteGuard
from allhands.env import gloo_interface, worker_env
from allhands.heartbeat import Heartbeat
from allhands.mesh import Mesh
from allhands.metrics import MetricsWriter, iface_tx_bytes
from allhands.models import GPT, GPTConfig
from allhands.memory import local, log_memory, peak_memory, state_bytes
from allhands.parallel import apply_zero1, clip_grad_norm, parallelize
from allhands.parallel.pipeline import build_pipeline, clip_grads, global_grad_norm
from allhands.parallel.zero1 import optimizer_for_checkpoint
from allhands.sync import build_sync

ModelFn = Callable[[Config], nn.Module]
DataFn = Callable[[Config], Any]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Job:
    """What a user brings. ``None`` fields take the reference GPT, token shards and LM loss."""

    model: ModelFn | None = None
    data: DataFn | None = None
    loss: LossFn | None = None
    tp_plan: Any = None  # {fqn: ParallelStyle} or (model, sequence_parallel) -> that; see parallel/tensor.py


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; logits ``(B, T, V)``, targets ``(B, T)``."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def build_reference_model(cfg: Config, vocab_size: int) -> GPT:
    m = cfg.model
    return GPT(GPTConfig(vocab_size=m.vocab_size or vocab_size, seq_len=m.seq_len, n_layer=m.n_layer,
                         n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
                         tie_embeddings=m.tie_embeddings))


def build_data(cfg: Config, job: Job):
    """(train, val or None, vocab_size or None)."""
    if job.data is not None:
        out = job.data(cfg)
        train, val = out if isinstance(out, tuple) else (out, None)
        return train, val, None
    train, val, meta = load_token_splits(cfg.data.path, cfg.model.seq_len)
    if cfg.model.vocab_size and cfg.model.vocab_size < meta["vocab_size"]:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the data's "
                          f"vocabulary {meta['vocab_size']}; use 0 to take it from the data")
    return train, val, meta["vocab_size"]


def build_optimizer(model: nn.Module | list[nn.Module], cfg: Config) -> torch.optim.Optimizer:
    """AdamW (or plain SGD, the linear case the DiLoCo H=1 test needs); weight decay on
    matrices only (GPT-2/nanoGPT convention). ``model`` may be the list of this rank's pipeline
    stages."""
    o = cfg.optim
    decay, no_decay = [], []
    if isinstance(model, list):
        if len(model) > 1:
            return OptimizerParts([build_optimizer(m, cfg) for m in model])
        model = model[0]
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


class OptimizerParts(torch.optim.Optimizer):
    """One AdamW per pipeline stage of this rank (interleaved schedules hold several), stepped
    as one. Its ``param_groups`` are the stages' own group dicts, so one LR scheduler drives all."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        super().__init__([q for o in optimizers for g in o.param_groups for q in g["params"]],
                         dict(optimizers[0].defaults))
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    @property
    def state(self):  # every stage's state, e.g. for counting its bytes
        return {p: st for o in self.optimizers for p, st in o.state.items()}

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ assigns an empty one; stages hold theirs
        pass

    def step(self, closure=None):  # the stages' optimizers step in turn
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine to ``min_lr_ratio`` at the last step."""
    o, total = cfg.optim, cfg.run.steps

    def f(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        span = max(1, total - o.warmup_steps)
        progress = min(1.0, (step - o.warmup_steps) / span)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def param_checksums(model: nn.Module) -> torch.Tensor:
    """One float64 sum per parameter, over this rank's local shard of a DTensor."""
    return torch.stack([local(p).detach().double().sum() for p in model.parameters()])


class Trainer:
    def __init__(self, cfg: Config, job: Job, mesh: Mesh, run_dir: Path):
        self.cfg, self.job, self.mesh, self.run_dir = cfg, job, mesh, run_dir
        r = cfg.run
        if mesh.device.type == "cpu" and r.threads:
            torch.set_num_threads(r.threads)
        self.train_ds, self.val_ds, vocab = build_data(cfg, job)
        # Same seed on every rank for initialisation; DDP also broadcasts rank 0's weights.
        torch.manual_seed(r.seed)
        raw = job.model(cfg) if job.model is not None else build_reference_model(cfg, vocab)
        self.raw_model = raw.to(mesh.device)
        if cfg.checkpoint.init_from:  # before any sharding: a plain module takes plain tensors
            load_weights(self.raw_model, cfg.checkpoint.init_from)
        seed_rank(r.seed, mesh.rank)
        self.loss_fn = job.loss or lm_loss
        p = cfg.parallel
        use_bf16 = r.precision == "bf16" or (r.precision == "auto" and mesh.device.type == "cuda")
        # bf16 under FSDP is its MixedPrecisionPolicy (bf16 compute, fp32 shards and reduction);
        # replicated layouts use autocast over fp32 parameters.
        fsdp_mp = use_bf16 and p.zero >= 2
        self.strategy, self.sync_note = build_sync(cfg, mesh, self.raw_model)
        # Pipeline split first (the stages are what every later strategy cuts), then each part
        # is parallelized in parallelize()'s order. Without pp there is one part: the model.
        self.pipeline = None
        parts = [self.raw_model]
        if mesh.size("pp") > 1:
            self.pipeline = build_pipeline(
                self.raw_model, pp_rank=mesh.local_rank("pp"), pp_size=mesh.size("pp"),
                group=mesh.group("pp"), schedule=p.pp_schedule,
                n_microbatches=pp_microbatches(p, mesh.size("pp")),
                stages_per_rank=pp_stages_per_rank(p),
                split_points=[s.strip() for s in p.pp_split.split(",")] if p.pp_split else None,
                tied_group=mesh.pp_ends_group() if mesh.size("pp") > 2 else None)
            parts = self.pipeline.modules
            del self.raw_model  # the unsplit copy is not trained; free it
        wrapped = [self.strategy.wrap(
            parallelize(part, mesh, zero=p.zero, ac=p.ac, bucket_mb=p.bucket_mb,
                        param_dtype=torch.bfloat16 if fsdp_mp else None,
                        reduce_dtype=(torch.float32 if p.reduce_dtype == "fp32" else torch.bfloat16)
                        if fsdp_mp else None,
                        replicate=not self.strategy.reconciles_replicas,
                        sequence_parallel=p.tp_sequence_parallel, tp_plan=job.tp_plan,
                        pipeline_stage=self.pipeline is not None), mesh)
            for part in parts]
        self.parts = parts  # parallelized in place: their parameters are the trained ones
        if self.pipeline is not None:
            self.pipeline.modules = wrapped
            self.pipeline.start(mesh.device, self.loss_fn)
        self.raw_model = parts[0]
        self.model = wrapped[0] if len(wrapped) == 1 else wrapped
        self.optimizer = build_optimizer(parts, cfg)
        if p.zero == 1:
            self.optimizer = apply_zero1(self.optimizer, mesh)
        self.strategy.attach_optimizer(self.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.sampler = GlobalSampler(len(self.train_ds), r.global_batch, cfg.data.seed)
        self.val_sampler = (GlobalSampler(len(self.val_ds), r.global_batch, cfg.data.seed + 1)
                            if self.val_ds is not None and len(self.val_ds) else None)
        self.train_state = TrainState()
        self.rng_state = RNGState(mesh.rank)
        self.faults = FaultInjector(cfg.fault.inject, mesh.rank, run_dir)
        self.guard = NonFiniteGuard(cfg.fault.nonfinite, cfg.fault.max_nonfinite)
        self.heartbeat = Heartbeat(worker_env().heartbeat_dir, mesh.rank)
        self.rollbacks = 0
        c = cfg.checkpoint
        self.ckpt = Checkpointer(run_dir / "checkpoints", rank=mesh.rank, keep_last=c.keep_last,
                                 mode=c.mode, group=mesh.checkpoint_group() if c.mode == "async" else None,
                                 meta={"config": cfg.to_dict(), "world_size": mesh.world_size},
                                 writer_hook=self.faults.ckpt_writer_hook)
        self.autocast = (lambda: torch.autocast(mesh.device.type, dtype=torch.bfloat16)) \
            if use_bf16 and not fsdp_mp else contextlib.nullcontext
        self.memory: dict[str, int] | None = None
        self.tokens_per_sample: int | None = None
        # Communication accounting between two logged steps (see _log_step).
        self._tx_at_log = iface_tx_bytes(gloo_interface()) if mesh.node_local_rank == 0 else None
        self.net_iface = gloo_interface() if self._tx_at_log is not None else None
        self._window = [0, 0.0]  # steps, summed step seconds since the last logged step

    # -- checkpoint contract
    def state(self) -> dict[str, Any]:
        # ZeRO-1: the rank's local optimizer over the parameters it owns (see parallel/zero1.py).
        optim = optimizer_for_checkpoint(self.optimizer)
        aliases = self.pipeline.optimizer_aliases() if self.pipeline is not None else None
        return {"model": ModelOptimState(self.model, optim, aliases), "scheduler": self.scheduler,
                "train": self.train_state, "rng": self.rng_state, "sync": self.strategy}

    def maybe_resume(self) -> bool:
        """Load the newest committed checkpoint that verifies (falling back past damaged ones)."""

        def state_for(step: int, path: Path) -> dict[str, Any]:
            check_compatible(path, self.cfg.to_dict())
            state = self.state()
            keys = self.ckpt.saved_keys(path)
            self.strategy.saved_keys(keys)  # before DCP asks it for its state_dict
            if not any(k.startswith(f"rng.{self.rng_state.key}.") for k in keys):
                # A rank that did not exist when this was saved (resume on more workers): its
                # generators are re-seeded from (seed, rank, step), reproducibly.
                del state["rng"]
                seed_rank(self.cfg.run.seed + step, self.mesh.rank)
            return state

        warn = (lambda m: print(m, file=sys.stderr, flush=True)) if self.mesh.is_main else (lambda m: None)
        loaded = self.ckpt.load_latest(state_for, warn)
        if loaded is None:
            return False
        step, path = loaded
        if self.train_state.step != step:
            raise CheckpointError(f"checkpoint {str(path)!r} says step {self.train_state.step}, "
                                  f"its name says {step}; the checkpoint is inconsistent")
        return True

    def save(self) -> None:
        self.ckpt.save(self.train_state.step, self.state())

    # -- the loop
    def _to_device(self, batch):
        return [t.to(self.mesh.device, non_blocking=True) for t in batch]

    def evaluate(self) -> float | None:
        if self.val_sampler is None or self.cfg.data.eval_batches == 0:
            return None
        for part in self.parts:
            part.eval()
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad(), self.autocast():
            for b in range(self.cfg.data.eval_batches):
                idx = self.val_sampler.local_micro_batches(b, self.mesh.dp_rank, self.mesh.dp_size, 1)[0]
                x, y = self._to_device(collate(self.val_ds, idx))
                loss = (self.pipeline.eval(x, y) if self.pipeline is not None
                        else self.loss_fn(self.raw_model(x), y))
                if self._reports_loss:
                    total[0] += float(loss) * len(idx)
                    total[1] += len(idx)
        for part in self.parts:
            part.train()
        # one contribution per data-parallel rank: its last pipeline stage's, from tp rank 0
        dist.all_reduce(total)
        return float(total[0] / total[1])

    @property
    def _reports_loss(self) -> bool:
        """This rank holds the loss (last pipeline stage) and is the one of its tp group to report it."""
        return (self.pipeline is None or self.pipeline.has_last) and self.mesh.local_rank("tp") == 0

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, scale: float,
                          fault_step: int | None = None) -> torch.Tensor | None:
        """One micro-batch; returns its scaled loss, or None on a rank without the last stage.
        ``fault_step``: the step whose injected faults (fault.inject "nan") apply to this loss."""
        if self.pipeline is not None:
            # the schedule runs this rank's stages over parallel.pp_microbatches chunks
            return self.pipeline.step(x, y, loss_scale=scale)
        loss = self.loss_fn(self.model(x), y) * scale
        if fault_step is not None:
            loss = self.faults.after_forward(fault_step + 1, loss)
        loss.backward()
        return loss.detach()

    def _clip(self) -> torch.Tensor:
        clip = self.cfg.optim.grad_clip
        params = [q for part in self.parts for q in part.parameters()]
        if self.pipeline is None and self.mesh.size("tp") == 1:
            return clip_grad_norm(params, clip if clip > 0 else math.inf)
        # the norm of the whole model: over tp/FSDP shards (mixed meshes) and pipeline stages
        pp_group = self.mesh.group("pp") if self.pipeline is not None else None
        skip = self.pipeline.norm_duplicates() if self.pipeline is not None else set()
        norm = global_grad_norm(params, pp_group=pp_group, skip=skip)
        clip_grads(params, clip, norm)
        return norm

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.cfg.run
        micro = self.sampler.local_micro_batches(step, self.mesh.dp_rank, self.mesh.dp_size,
                                                 r.micro_batches)
        loss_sum = torch.zeros((), device=self.mesh.device)
        for i, idx in enumerate(micro):
            x, y = self._to_device(collate(self.train_ds, idx))
            if self.tokens_per_sample is None:
                self.tokens_per_sample = x.shape[1] if x.dim() == 2 and not x.is_floating_point() else 1
            with self.strategy.micro_step(self.model, last=i == len(micro) - 1):
                with self.autocast():
                    loss = self._forward_backward(x, y, 1.0 / len(micro), step if i == 0 else None)
            if loss is not None:
                loss_sum += loss
        if self.pipeline is not None:
            self.pipeline.sync_tied_grads()
        gnorm = self._clip()
        # No GradScaler: fp32 on CPU needs none and bf16 autocast keeps fp32's exponent range.
        # Every rank decides alike (one all_reduce), whatever the sync strategy did to the grads.
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(gnorm)) else 1.0],
                           device=self.mesh.device)
        if self.strategy.lockstep:  # an asynchronous worker decides alone
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self.last_action = self.guard.check(not bool(bad.item()), step + 1)
        self.ckpt.before_update()  # an async save's copy of the parameters overlapped up to here
        if self.last_action == "ok":
            self.optimizer.step()
        # Skipped or not, the batch is consumed and the schedule advances: later steps see the
        # same data and learning rate as in a run without the bad step.
        if self.memory is None:  # the first moment gradients and optimizer state both exist
            self.memory = state_bytes(self.raw_model if len(self.parts) == 1
                                      else nn.ModuleList(self.parts), self.optimizer)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, gnorm

    def check_replicas(self, step: int) -> None:
        # Sharded layouts (zero 2/3) hold equal shards only across dp_replicate.
        dim = "dp_replicate" if self.cfg.parallel.zero >= 2 else "dp"
        mine = torch.cat([param_checksums(part) for part in self.parts]).cpu()
        gathered = [torch.empty_like(mine) for _ in range(self.mesh.size(dim))]
        dist.all_gather(gathered, mine, group=self.mesh.group(dim))
        for rank, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                bad = int((other != gathered[0]).nonzero()[0])
                name = [n for part in self.parts for n, _ in part.named_parameters()][bad]
                raise RuntimeError(f"replicas diverged after step {step}: rank {rank}'s parameter "
                                   f"{name!r} differs from rank 0's")

    def fit(self) -> dict[str, Any]:
        cfg, r, mesh = self.cfg, self.cfg.run, self.mesh
        resumed = self.maybe_resume()
        ts = self.train_state
        metrics = MetricsWriter(self.run_dir, enabled=mesh.is_main, total_steps=r.steps,
                                start_step=ts.step, progress=cfg.log.progress,
                                tensorboard=cfg.log.tensorboard)
        metrics.message(f"allhands: {self.sync_note}")
        if resumed:
            metrics.message(f"allhands: resumed from step {ts.step} in {self.run_dir} "
                            f"({mesh.describe()})")
        # Also right after a resume: the checkpoint's eval loss under this layout, which must
        # equal the one logged when it was saved, under any other layout (DCP reshards).
        ev = self.evaluate()
        if ev is not None:
            metrics.log({"step": ts.step, "eval_loss": ev, **({"resumed": True} if resumed else {})})
        result: dict[str, Any] = {}
        logged_memory = False
        cadence = Cadence(cfg.checkpoint.interval, cfg.checkpoint.max_overhead, ts.step, mesh.device)
        self.heartbeat.beat(ts.step)
        try:
            while ts.step < r.steps:
                self.faults.before_step(ts.step + 1)
                self.heartbeat.beat(ts.step + 1)  # "working on step ts.step + 1": see supervise.py
                t0 = time.perf_counter()
                loss_sum, gnorm = self.train_step(ts.step)
                if self.last_action == "rollback" and self._rollback(metrics):
                    continue
                if self.last_action != "ok":
                    ts.nonfinite_skips += 1
                    metrics.message(f"allhands: warning: non-finite loss or gradient at step "
                                    f"{ts.step + 1}; update skipped ({ts.nonfinite_skips} so far)")
                ts.step += 1
                ts.samples += r.global_batch
                self.strategy.after_step(ts.step)
                if not logged_memory:
                    logged_memory = log_memory(metrics, self.memory, self.raw_model, self.mesh,
                                               zero=cfg.parallel.zero, step=ts.step)
                if r.check_sync and self.strategy.in_sync(ts.step):
                    self.check_replicas(ts.step)
                dt = time.perf_counter() - t0
                self._window[0] += 1
                self._window[1] += dt
                last = ts.step == r.steps
                if ts.step % cfg.log.interval == 0 or last:
                    result = self._log_step(metrics, loss_sum, gnorm, dt)
                if (r.eval_interval and ts.step % r.eval_interval == 0) or last:
                    ev = self.evaluate()
                    if ev is not None:
                        metrics.log({"step": ts.step, "eval_loss": ev})
                        result["eval_loss"] = ev
                cadence.step_done(dt, self.ckpt.in_flight)
                if cadence.due(ts.step) or (last and cfg.checkpoint.at_end):
                    note = cadence.save(ts.step, self.save)
                    if note:
                        metrics.message(note)
                    if cfg.checkpoint.max_overhead > 0:  # each save, and the next one's distance
                        metrics.log({"step": ts.step, "checkpoint_saved": True,
                                     "checkpoint_interval": cadence.interval, **cadence.inputs})
                self.ckpt.poll()
                self._report_checkpoint_warnings(metrics)
            failures = self.ckpt.failures
            self.ckpt.wait()
            self._report_checkpoint_warnings(metrics)
            if cfg.checkpoint.at_end and self.ckpt.failures > failures:
                raise CheckpointError(f"the final checkpoint (step {ts.step}) was not saved; the "
                                      f"last committed one is intact; free space or fix permissions "
                                      f"of {str(self.ckpt.dir)!r} and resume")
            self.heartbeat.beat(ts.step, done=True)
        except BaseException:
            self.ckpt.drain()  # a failure shortly after a save: let that save commit first
            raise
        finally:
            self.ckpt.close()
            metrics.close(summary=ts.step >= r.steps)
        return result

    def _report_checkpoint_warnings(self, metrics: MetricsWriter) -> None:
        for w in self.ckpt.warnings:
            metrics.message(f"allhands: warning: {w}")
        if self.ckpt.warnings:  # a failed save surfaces asynchronously: its own metrics line
            metrics.log({"step": self.train_state.step, "checkpoint_failures": self.ckpt.failures,
                         "time": time.time()})
        self.ckpt.warnings.clear()

    def _rollback(self, metrics: MetricsWriter) -> bool:
        """Reload the last committed checkpoint after a non-finite step; False if there is none
        (the step is then skipped)."""
        self.ckpt.wait()
        ts = self.train_state
        skips, bad_step = ts.nonfinite_skips + 1, ts.step + 1
        if self.ckpt.latest() is None:
            return False
        self.maybe_resume()
        ts.nonfinite_skips = skips
        self.rollbacks += 1
        metrics.message(f"allhands: warning: non-finite loss or gradient at step {bad_step}; rolled "
                        f"back to step {ts.step} (rollback {self.rollbacks})")
        return True

    def _log_step(self, metrics: MetricsWriter, loss_sum: torch.Tensor, gnorm: torch.Tensor,
                  dt: float) -> dict[str, Any]:
        """One small all_gather per logged step: the mean loss of the ranks that hold one (last
        pipeline stage, tp rank 0), each rank's step time and peak memory, and the communication
        each rank recorded since the last logged step (bytes from the collectives' sizes, in the
        lab also the interface's counter; seconds in flight and exposed)."""
        mesh, r = self.mesh, self.cfg.run
        peak, peak_kind = peak_memory(mesh.device)
        payload, wire, comm_s, exposed_s = self.strategy.comm.take()
        tx = iface_tx_bytes(self.net_iface)
        sent = tx - self._tx_at_log if tx is not None and self._tx_at_log is not None else 0.0
        self._tx_at_log = tx
        steps, window_s = self._window
        self._window = [0, 0.0]
        mine = torch.tensor([float(loss_sum), dt, payload, wire, comm_s, exposed_s, sent, window_s,
                             peak, float(self._reports_loss)], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(mesh.world_size)]
        dist.all_gather(gathered, mine)
        g = torch.stack(gathered)  # (world, 10)
        losses = g[g[:, 9] > 0, 0].tolist()
        times = g[:, 1].tolist()
        per_step = max(steps, 1)
        step_time = max(times)
        samples_per_s = r.global_batch / step_time
        record = {
            "step": self.train_state.step, "loss": sum(losses) / len(losses),
            "lr": self.scheduler.get_last_lr()[0], "grad_norm": float(gnorm),
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * (self.tokens_per_sample or 1),
            "step_time": step_time, "step_time_rank": times, "time": time.time(),
            "peak_mem_bytes_rank": [int(v) for v in g[:, 8].tolist()], "peak_mem_kind": peak_kind,
            "nonfinite_skips": self.train_state.nonfinite_skips,
            "checkpoint_failures": self.ckpt.failures, "rollbacks": self.rollbacks,
            # Per step, averaged over the steps since the last logged one (DiLoCo: 1/H of a round).
            "comm_bytes": float(g[:, 2].mean()) / per_step,       # collective payload per rank
            "comm_wire_bytes": float(g[:, 3].mean()) / per_step,  # ring lower bound per rank
            "comm_time": float(g[:, 4].max()) / per_step,
            "comm_exposed": float(g[:, 5].max()) / per_step,
            "comm_exposed_frac": float((g[:, 5] / g[:, 7].clamp_min(1e-12)).max()),
        }
        if self.net_iface is not None or float(g[:, 6].sum()) > 0:
            record["net_tx_bytes"] = float(g[:, 6].sum()) / per_step  # all nodes' interfaces
        metrics.log(record)
        return record
