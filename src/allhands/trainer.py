"""The one training loop. It runs inside each worker process and does not know which sync
strategy, model or dataset it was given.

Per step: this rank's micro-batches of the global batch (sampler.py) -> forward/backward, with
the strategy deciding where gradients are reconciled -> clip -> AdamW step -> schedule step ->
metrics -> maybe eval -> maybe checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from allhands.checkpoint import Checkpointer, ModelOptimState, RNGState, TrainState, seed_rank
from allhands.config import Config
from allhands.data import GlobalSampler, load_token_splits
from allhands.data.sampler import collate
from allhands.errors import CheckpointError, ConfigError
from allhands.mesh import Mesh
from allhands.launch import gloo_interface
from allhands.metrics import MetricsWriter, iface_tx_bytes
from allhands.models import GPT, GPTConfig
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
    """AdamW (or plain SGD, the linear case the DiLoCo H=1 test needs); weight decay on
    matrices only (GPT-2/nanoGPT convention)."""
    o = cfg.optim
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr)
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
        self.strategy, self.sync_note = build_sync(cfg, mesh, self.raw_model)
        self.model = self.strategy.wrap(self.raw_model, mesh)
        self.optimizer = build_optimizer(self.raw_model, cfg)
        self.strategy.attach_optimizer(self.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.sampler = GlobalSampler(len(self.train_ds), r.global_batch, cfg.data.seed)
        self.val_sampler = (GlobalSampler(len(self.val_ds), r.global_batch, cfg.data.seed + 1)
                            if self.val_ds is not None and len(self.val_ds) else None)
        self.train_state = TrainState()
        self.rng_state = RNGState(mesh.rank)
        self.ckpt = Checkpointer(run_dir / "checkpoints", rank=mesh.rank,
                                 keep_last=cfg.checkpoint.keep_last)
        use_bf16 = r.precision == "bf16" or (r.precision == "auto" and mesh.device.type == "cuda")
        self.autocast = (lambda: torch.autocast(mesh.device.type, dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext
        self.tokens_per_sample: int | None = None
        # Communication accounting between two logged steps (see _log_step).
        self._tx_at_log = iface_tx_bytes(gloo_interface()) if mesh.local_rank == 0 else None
        self.net_iface = gloo_interface() if self._tx_at_log is not None else None
        self._window = [0, 0.0]  # steps, summed step seconds since the last logged step

    # -- checkpoint contract
    def state(self) -> dict[str, Any]:
        return {"model": ModelOptimState(self.model, self.optimizer), "scheduler": self.scheduler,
                "train": self.train_state, "rng": self.rng_state, "sync": self.strategy}

    def maybe_resume(self) -> bool:
        latest = self.ckpt.latest()
        if latest is None:
            return False
        step, path = latest
        state = self.state()
        keys = self.ckpt.saved_keys(path)
        if not any(k.startswith(f"rng.{self.rng_state.key}.") for k in keys):
            # A rank that did not exist when this was saved (resume on more workers): its
            # generators are re-seeded from (seed, rank, step), reproducibly.
            del state["rng"]
            seed_rank(self.cfg.run.seed + step, self.mesh.rank)
        self.ckpt.load(path, state)
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
                loss.backward()
            loss_sum += loss.detach()
        clip = self.cfg.optim.grad_clip
        gnorm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip if clip > 0 else math.inf)
        self.optimizer.step()
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
        metrics.message(f"allhands: {self.sync_note}")
        if resumed:
            metrics.message(f"allhands: resumed from step {ts.step} in {self.run_dir}")
        else:
            ev = self.evaluate()
            if ev is not None:
                metrics.log({"step": 0, "eval_loss": ev})
        result: dict[str, Any] = {}
        try:
            while ts.step < r.steps:
                t0 = time.perf_counter()
                loss_sum, gnorm = self.train_step(ts.step)
                ts.step += 1
                ts.samples += r.global_batch
                self.strategy.after_step(ts.step)
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
                interval = cfg.checkpoint.interval
                if (interval and ts.step % interval == 0) or (last and cfg.checkpoint.at_end):
                    self.save()
        finally:
            metrics.close(summary=ts.step >= r.steps)
        return result

    def _log_step(self, metrics: MetricsWriter, loss_sum: torch.Tensor, gnorm: torch.Tensor,
                  dt: float) -> dict[str, Any]:
        """One small all_gather per logged step: mean loss, each rank's step time, and the
        communication each rank recorded since the last logged step (bytes from the collectives'
        sizes, in the lab also the interface's counter; seconds in flight and exposed)."""
        mesh, r = self.mesh, self.cfg.run
        payload, wire, comm_s, exposed_s = self.strategy.comm.take()
        tx = iface_tx_bytes(self.net_iface)
        sent = tx - self._tx_at_log if tx is not None and self._tx_at_log is not None else 0.0
        self._tx_at_log = tx
        steps, window_s = self._window
        self._window = [0, 0.0]
        mine = torch.tensor([float(loss_sum), dt, payload, wire, comm_s, exposed_s, sent, window_s],
                            dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(mesh.world_size)]
        dist.all_gather(gathered, mine)
        g = torch.stack(gathered)  # (world, 8)
        losses = g[:, 0].tolist()
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
