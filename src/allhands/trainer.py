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

from allhands.checkpoint import (Checkpointer, ModelOptimState, RNGState, TrainState, check_compatible,
                                 seed_rank)
from allhands.config import Config
from allhands.data import GlobalSampler, load_token_splits
from allhands.data.sampler import collate
from allhands.errors import CheckpointError, ConfigError
from allhands.faults import FaultInjector, NonFiniteGuard
from allhands.launch import worker_env
from allhands.mesh import Mesh
from allhands.metrics import MetricsWriter
from allhands.models import GPT, GPTConfig
from allhands.supervise import Heartbeat
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


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; logits ``(B, T, V)``, targets ``(B, T)``."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def build_reference_model(cfg: Config, vocab_size: int) -> GPT:
    m = cfg.model
    return GPT(GPTConfig(vocab_size=m.vocab_size or vocab_size, seq_len=m.seq_len, n_layer=m.n_layer,
                         n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias))


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


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (GPT-2/nanoGPT convention)."""
    o = cfg.optim
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


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
    return torch.stack([p.detach().double().sum() for p in model.parameters()])


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
        seed_rank(r.seed, mesh.rank)
        self.loss_fn = job.loss or lm_loss
        self.strategy = build_sync(cfg.parallel.sync, bucket_mb=cfg.parallel.bucket_mb)
        self.model = self.strategy.wrap(self.raw_model, mesh)
        self.optimizer = build_optimizer(self.raw_model, cfg)
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
        use_bf16 = r.precision == "bf16" or (r.precision == "auto" and mesh.device.type == "cuda")
        self.autocast = (lambda: torch.autocast(mesh.device.type, dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext
        self.tokens_per_sample: int | None = None

    # -- checkpoint contract
    def state(self) -> dict[str, Any]:
        return {"model": ModelOptimState(self.model, self.optimizer), "scheduler": self.scheduler,
                "train": self.train_state, "rng": self.rng_state, "sync": self.strategy}

    def maybe_resume(self) -> bool:
        """Load the newest committed checkpoint that verifies (falling back past damaged ones)."""

        def state_for(step: int, path: Path) -> dict[str, Any]:
            check_compatible(path, self.cfg.to_dict())
            state = self.state()
            keys = self.ckpt.saved_keys(path)
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
        self.raw_model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad(), self.autocast():
            for b in range(self.cfg.data.eval_batches):
                idx = self.val_sampler.local_micro_batches(b, self.mesh.dp_rank, self.mesh.dp_size, 1)[0]
                x, y = self._to_device(collate(self.val_ds, idx))
                total[0] += float(self.loss_fn(self.raw_model(x), y)) * len(idx)
                total[1] += len(idx)
        self.raw_model.train()
        dist.all_reduce(total, group=self.mesh.dp_group)
        return float(total[0] / total[1])

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
                    loss = self.loss_fn(self.model(x), y) / len(micro)
                if i == 0:
                    loss = self.faults.after_forward(step + 1, loss)
                loss.backward()
            loss_sum += loss.detach()
        clip = self.cfg.optim.grad_clip
        gnorm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip if clip > 0 else math.inf)
        # No GradScaler: fp32 on CPU needs none and bf16 autocast keeps fp32's exponent range.
        # Every rank decides alike (one all_reduce), whatever the sync strategy did to the grads.
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(gnorm)) else 1.0],
                           device=self.mesh.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self.last_action = self.guard.check(not bool(bad.item()), step + 1)
        if self.last_action == "ok":
            self.optimizer.step()
        # Skipped or not, the batch is consumed and the schedule advances: later steps see the
        # same data and learning rate as in a run without the bad step.
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, gnorm

    def check_replicas(self, step: int) -> None:
        mine = param_checksums(self.raw_model).cpu()
        gathered = [torch.empty_like(mine) for _ in range(self.mesh.dp_size)]
        dist.all_gather(gathered, mine, group=self.mesh.dp_group)
        for rank, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                bad = int((other != gathered[0]).nonzero()[0])
                name = [n for n, _ in self.raw_model.named_parameters()][bad]
                raise RuntimeError(f"replicas diverged after step {step}: rank {rank}'s parameter "
                                   f"{name!r} differs from rank 0's")

    def fit(self) -> dict[str, Any]:
        cfg, r, mesh = self.cfg, self.cfg.run, self.mesh
        resumed = self.maybe_resume()
        ts = self.train_state
        metrics = MetricsWriter(self.run_dir, enabled=mesh.is_main, total_steps=r.steps,
                                start_step=ts.step, progress=cfg.log.progress,
                                tensorboard=cfg.log.tensorboard)
        if resumed:
            metrics.message(f"allhands: resumed from step {ts.step} in {self.run_dir}")
        else:
            ev = self.evaluate()
            if ev is not None:
                metrics.log({"step": 0, "eval_loss": ev})
        result: dict[str, Any] = {}
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
                if r.check_sync:
                    self.check_replicas(ts.step)
                dt = time.perf_counter() - t0
                last = ts.step == r.steps
                if ts.step % cfg.log.interval == 0 or last:
                    result = self._log_step(metrics, loss_sum, gnorm, dt)
                if (r.eval_interval and ts.step % r.eval_interval == 0) or last:
                    ev = self.evaluate()
                    if ev is not None:
                        metrics.log({"step": ts.step, "eval_loss": ev})
                        result["eval_loss"] = ev
                interval = cfg.checkpoint.interval
                if (interval and ts.step % interval == 0) or (last and cfg.checkpoint.at_end):
                    self.save()
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
        """One small all_gather of (loss, step time) per logged step: mean loss, each rank's time."""
        mesh, r = self.mesh, self.cfg.run
        mine = torch.tensor([float(loss_sum), dt], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(mesh.world_size)]
        dist.all_gather(gathered, mine)
        losses = [float(g[0]) for g in gathered]
        times = [float(g[1]) for g in gathered]
        step_time = max(times)
        samples_per_s = r.global_batch / step_time
        record = {
            "step": self.train_state.step, "loss": sum(losses) / len(losses),
            "lr": self.scheduler.get_last_lr()[0], "grad_norm": float(gnorm),
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * (self.tokens_per_sample or 1),
            "step_time": step_time, "step_time_rank": times, "time": time.time(),
            "nonfinite_skips": self.train_state.nonfinite_skips,
            "checkpoint_failures": self.ckpt.failures, "rollbacks": self.rollbacks,
        }
        metrics.log(record)
        return record
