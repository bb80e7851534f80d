"""The one training loop. It runs inside each worker process and does not know which sync
strategy, layout, model or dataset it was given.

Per step: this rank's micro-batches of the global batch (sampler.py) -> forward/backward on
the layout's parts (parallel/layout.py), with the strategy deciding where gradients are
reconciled -> clip -> AdamW step -> schedule step -> metrics -> maybe eval -> maybe checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from allhands.agree import StepAgreement
from allhands.checkpoint import (Cadence, Checkpointer, RNGState, TrainState, load_weights,
                                 seed_rank, sharded_loader)
from allhands.config import Config
from allhands.data.sampler import collate
from allhands.errors import CheckpointError
from allhands.faults import FaultInjector, NonFiniteGuard
from allhands.flops import StepFlops
from allhands.env import worker_env
from allhands.evaluate import check_replicas, evaluate
from allhands.heartbeat import Heartbeat
from allhands.hooks import LoopHooks
from allhands.jobcheck import checked_data, checked_loss, checked_model, sampler_for
from allhands.data.examples import valid_targets
from allhands.job import Job, TokenMeanLoss, build_data, build_reference_model, default_loss
from allhands.mesh import Mesh
from allhands.models.init import InitRecord, materializer
from allhands.metrics import MetricsWriter, slow_phase
from allhands.optim import lr_lambda, skip_on_device
from allhands.parallel.compiled import compile_line, compile_record
from allhands.parallel.layout import build_layout
from allhands.parallel.moe_metrics import moe_record
from allhands.plan.decoder import flops_per_sample
from allhands.steplog import StepLog
from allhands.sync import SyncBuilder, build_sync
from allhands.trackers import selected
from allhands.trainer_checkpoints import RunCheckpoints

__all__ = ["Job", "Trainer"]  # Job re-exported: ``from allhands.trainer import Job, Trainer``


class Trainer(RunCheckpoints):
    """``sync``: builds the sync strategy from (cfg, mesh, model); a mode with a strategy of its
    own (the parameter server) passes its builder. ``hooks``: what a mode adds at the loop's fixed
    points (hooks.py); a mode may also set them after construction, before ``fit``."""

    def __init__(self, cfg: Config, job: Job, mesh: Mesh, run_dir: Path, *,
                 sync: SyncBuilder = build_sync, hooks: LoopHooks | None = None):
        self.cfg, self.job, self.mesh, self.run_dir = cfg, job, mesh, run_dir
        r = cfg.run
        if mesh.device.type == "cpu" and r.threads:
            torch.set_num_threads(r.threads)
        self.train_ds, self.val_ds, vocab = build_data(cfg, job)
        self.train_ds, self.val_ds = checked_data(self.train_ds, self.val_ds, r.global_batch)
        # Same seed on every rank for initialisation; DDP also broadcasts rank 0's weights.
        torch.manual_seed(r.seed)
        # A shipped family is built on the meta device and each rank allocates only its cut
        # (build_layout's load): the constructor's draws replayed from this seed (models/init.py)
        # or read by slice from a transformers directory. A user's model, or weights that
        # load_weights reads whole, go into the plain module.
        init = cfg.checkpoint.init_from
        load_cut = sharded_loader(init, mesh.device) if init else None
        meta = job.model is None and (not init or load_cut is not None)
        record = InitRecord() if meta else contextlib.nullcontext()
        with torch.device("meta") if meta else contextlib.nullcontext(), record:
            raw = job.model(cfg) if job.model is not None else build_reference_model(cfg, vocab)
        raw = checked_model(raw) if meta else checked_model(raw).to(mesh.device)
        if init and load_cut is None:
            load_weights(raw, init)
        if meta and load_cut is None:
            load_cut = materializer(raw, record, mesh.device)
        seed_rank(r.seed, mesh.rank)
        self.loss_fn = checked_loss(job.loss) if job.loss else default_loss(self.train_ds)
        self.strategy, self.sync_note = sync(cfg, mesh, raw)
        # Every layout decision (model split, TP, AC, FSDP/DDP, optimizer sharding, where bf16
        # comes from) is made here, once; the loop below runs whatever it built.
        self.layout = build_layout(cfg, mesh, raw, self.strategy, self.loss_fn, job.tp_plan, load=load_cut)
        del raw  # the layout's parts hold what this rank trains
        self.parts, self.model = self.layout.parts, self.layout.model
        self.raw_model = self.parts[0]  # parallelized in place: its parameters are the trained ones
        self.optimizer = self.layout.optimizer
        self.strategy.attach_optimizer(self.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.sampler = sampler_for(self.train_ds, r.global_batch, cfg.data.seed)
        self.val_sampler = sampler_for(self.val_ds, r.global_batch, cfg.data.seed + 1)
        self.train_state = TrainState()
        self.rng_state = RNGState(mesh.rank)
        self.faults = FaultInjector(cfg.fault.inject, mesh.rank, run_dir)
        self.guard = NonFiniteGuard(cfg.fault.nonfinite, cfg.fault.max_nonfinite)
        self.agree = StepAgreement(self.guard, lockstep=self.strategy.lockstep, device=mesh.device,
                                   grads_agree=self.strategy.grads_agree, stop_signal=lambda: self.hooks.stop_signal())
        self.heartbeat = Heartbeat(worker_env().heartbeat_dir, mesh.rank)
        self.rollbacks = 0
        c = cfg.checkpoint
        self.ckpt = Checkpointer(run_dir / "checkpoints", rank=mesh.rank, keep_last=c.keep_last,
                                 mode=c.mode, group=mesh.checkpoint_group() if c.mode == "async" else None,
                                 meta={"config": cfg.to_dict(), "world_size": mesh.world_size},
                                 writer_hook=self.faults.ckpt_writer_hook)
        self.memory: dict[str, int] | None = None
        self.tokens_per_sample: int | None = None
        self.steplog = StepLog(mesh, r.global_batch)
        prec = self.layout.precision
        # FLOPs are counted once, on this rank's first batch (fit); every sample is read once,
        # in order, so a dataset that records its reads or a stream sees nothing extra.
        self._count_flops = functools.partial(
            StepFlops.start,
            (lambda: job.model(cfg)) if job.model else (lambda: build_reference_model(cfg, vocab)),
            loss_fn=self.loss_fn, global_batch=r.global_batch, device=mesh.device,
            bf16=prec.autocast or prec.param_dtype == torch.bfloat16, threads=torch.get_num_threads(),
            devices=mesh.world_size, leader=mesh.node_local_rank == 0, barrier=dist.barrier,
            formula=None if job.model else functools.partial(flops_per_sample, cfg.model, cfg.moe, vocab),
            peak_tflops=cfg.log.peak_tflops)
        self.flops: StepFlops | None = None
        self.saved_step = -1  # the step of this process's last save, alike on every rank
        self.stop_signal = 0  # a stop signal every rank has agreed on (stopflag.py)
        self._first: tuple[int, Any] | None = None  # (step, batch) read ahead for the FLOP count
        self.hooks = hooks or LoopHooks()
        self.resume = True  # False: a replica-mode spare that takes its state from live peers
        self.resume_also: list[Path] = []  # other replica groups' checkpoints (replica/start.py)

    def move_to(self, run_dir: Path) -> None:
        """Write metrics and checkpoints under ``run_dir`` instead, before ``fit``: replica mode's
        spare is built before it knows which group's place it takes (replica/start.py)."""
        self.run_dir, self.ckpt.dir = run_dir, run_dir / "checkpoints"

    # -- the loop
    def _to_device(self, batch):
        return [t.to(self.mesh.device, non_blocking=True) for t in batch]

    def evaluate(self) -> float | None:
        if self.val_sampler is None or self.cfg.data.eval_batches == 0:
            return None
        return evaluate(self.layout, self.val_ds, self.val_sampler, self.cfg.data.eval_batches,
                        self._to_device, weigh=lambda idx: self._begin_loss(self.val_ds, idx, calls=1))

    def _begin_loss(self, ds, indices: list[int], calls: int) -> int:
        """Weight of a batch of ``indices`` in a mean: its unmasked targets under the token
        mean (which is told them, and its ``calls`` times the layout's splits), else its samples."""
        if not isinstance(self.loss_fn, TokenMeanLoss):
            return len(indices)
        n = valid_targets(ds, indices)
        self.loss_fn.begin(n, calls * self.layout.loss_splits())
        return n

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.cfg.run
        micro = self.sampler.local_micro_batches(step, self.mesh.dp_rank, self.mesh.dp_size,
                                                 r.micro_batches)
        if isinstance(self.loss_fn, TokenMeanLoss):  # every rank counts the whole global batch
            self._begin_loss(self.train_ds, self.sampler.global_batch_indices(step),
                             calls=self.mesh.dp_size * r.micro_batches)
        loss_sum = torch.zeros((), device=self.mesh.device)
        first, self._first = self._first, None  # fit read this step's first micro-batch ahead
        for i, idx in enumerate(micro):
            batch = first[1] if i == 0 and first and first[0] == step else collate(self.train_ds, idx)
            x, y = self._to_device(batch)
            if self.tokens_per_sample is None:
                self.tokens_per_sample = x.shape[1] if x.dim() == 2 and not x.is_floating_point() else 1
            # fault.inject "nan" poisons the step's first loss
            on_loss = (lambda loss: self.faults.after_forward(step + 1, loss)) if i == 0 else None
            last = i == len(micro) - 1  # only its backward reduces the step's gradients
            with self.strategy.micro_step(self.model, last=last):
                with self.layout.autocast():
                    loss = self.layout.forward_backward(x, y, 1.0 / len(micro), on_loss, last=last)
            if loss is not None:
                loss_sum += loss
        self.layout.after_backward()
        if not self.hooks.reduce(self.parts, step):
            self.optimizer.zero_grad(set_to_none=True)  # discarded by every member of the quorum
            self.last_action = "discarded"
            return loss_sum, loss_sum.new_zeros(())
        gnorm = self.layout.clip(self.cfg.optim.grad_clip)
        # No GradScaler: fp32 on CPU needs none and bf16 autocast keeps fp32's exponent range.
        # Every rank decides alike, with no collective where the gradients agree (agree.py).
        self.last_action = self.agree.update(loss_sum, gnorm, step + 1,
                                             lambda bad: skip_on_device(self.optimizer, bad),
                                             read=self._logs(step + 1))
        self.ckpt.before_update()  # an async save's copy of the parameters overlapped up to here
        if self.last_action == "ok":
            self.optimizer.step()
        # Skipped or not, the batch is consumed and the schedule advances: later steps see the
        # same data and learning rate as in a run without the bad step.
        if self.memory is None:  # the first moment gradients and optimizer state both exist
            self.memory = self.layout.state_bytes()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, gnorm

    def _logs(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) writes a record: every ``log.interval``th, and the last."""
        return step % self.cfg.log.interval == 0 or step == self.cfg.run.steps

    def fit(self) -> dict[str, Any]:
        cfg, r, mesh = self.cfg, self.cfg.run, self.mesh
        t_load = time.perf_counter()
        resumed = self.maybe_resume() if self.resume else False
        t_load = time.perf_counter() - t_load
        ts = self.train_state
        metrics = MetricsWriter(self.run_dir, enabled=mesh.is_main, total_steps=r.steps,
                                start_step=ts.step, progress=cfg.log.progress,
                                progress_s=cfg.log.progress_s, config=cfg.to_dict(),
                                trackers=selected(cfg.log.trackers, cfg.log.tensorboard))
        if ts.step < r.steps and self.hooks.reads_ahead:
            idx = self.sampler.local_micro_batches(ts.step, mesh.dp_rank, mesh.dp_size,
                                                   r.micro_batches)[0]
            self._first = (ts.step, collate(self.train_ds, idx))
            self.flops = self._count_flops(self._first[1])
        metrics.message(f"allhands: {self.sync_note}")
        if self.flops is not None:
            metrics.message(self.flops.describe())
        if resumed:
            metrics.message(f"allhands: resumed from step {ts.step} in {self.run_dir} "
                            f"({mesh.describe()})")
            metrics.message(slow_phase(f"loading checkpoint step {ts.step}", t_load))
        # Also right after a resume: the checkpoint's eval loss under this layout, which must
        # equal the one logged when it was saved, under any other layout (DCP reshards).
        ev = self.evaluate()
        if ev is not None:
            metrics.log({"step": ts.step, "eval_loss": ev, **({"resumed": True} if resumed else {})})
        result: dict[str, Any] = {}
        logged_memory = False
        cadence = Cadence(cfg.checkpoint.interval, cfg.checkpoint.max_overhead, ts.step, mesh.device)
        first_step = ts.step + 1
        self.heartbeat.beat(ts.step)
        try:
            while ts.step < r.steps:
                if self.hooks.begin_step(self):
                    continue  # the state was replaced (healed from a peer): the step may have moved
                self.faults.before_step(ts.step + 1)
                self.heartbeat.beat(ts.step + 1)  # "working on step ts.step + 1": see supervise.py
                t0 = time.perf_counter()
                loss_sum, gnorm = self.train_step(ts.step)
                if self.last_action == "discarded":
                    continue
                if self.last_action == "rollback" and self._rollback(metrics):
                    continue
                if self.last_action != "ok":
                    ts.nonfinite_skips += 1
                    metrics.message(f"allhands: warning: non-finite loss or gradient at step "
                                    f"{ts.step + 1}; update skipped ({ts.nonfinite_skips} so far)")
                elif self.agree.skipped:  # skipped on the device, read at this logged step
                    ts.nonfinite_skips += self.agree.skipped
                    metrics.message(f"allhands: warning: non-finite loss or gradient at "
                                    f"{self.agree.skipped_at}; update skipped ({ts.nonfinite_skips} so far)")
                ts.step += 1
                ts.samples += r.global_batch
                self.strategy.after_step(ts.step)
                if self.hooks.after_step(self):
                    continue  # the step's work was rolled back (a discarded DiLoCo round)
                if not logged_memory:
                    logged_memory = self.layout.log_memory(metrics, self.memory, ts.step)
                if r.check_sync and self.strategy.in_sync(ts.step):
                    check_replicas(self.parts, mesh, self.layout.replica_dim, ts.step)
                dt = time.perf_counter() - t0
                if ts.step == first_step:  # builds caches, buckets and compiled graphs
                    metrics.message(slow_phase("the first step", dt))
                    if cfg.run.compile:
                        compiled = compile_record()
                        metrics.message(compile_line(compiled))
                        metrics.log({"step": ts.step, **compiled})
                self.steplog.step_done(dt)
                last = ts.step == r.steps
                logged = self._logs(ts.step)
                if logged:
                    window = self.steplog.window_steps
                    result = self.steplog.gather(
                        step=ts.step, loss_sum=loss_sum, gnorm=gnorm, dt=dt,
                        comm=self.strategy.comm.take(), reports_loss=self.layout.reports_loss,
                        lr=self.scheduler.get_last_lr()[0], tokens_per_sample=self.tokens_per_sample,
                        counters={"nonfinite_skips": ts.nonfinite_skips,
                                  "checkpoint_failures": self.ckpt.failures, "rollbacks": self.rollbacks},
                        stop_signal=self.hooks.stop_signal())
                    result.update(moe_record(self.parts, mesh, window))  # MoE layers only
                    if self.flops is not None:  # flops_per_step, achieved_flops, mfu
                        result.update(self.flops.fields(result["step_time"]))
                    metrics.log(result)
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
                # the largest signal (SIGTERM over SIGUSR1 over SIGINT) says how, alike everywhere
                self.stop_signal = self.agree.stop(ts.step, dt, self.steplog.agreed if logged else None)
                if self.stop_signal and not last:
                    self._stop_cleanly(self.stop_signal)
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
            self.heartbeat.close()  # its thread's last write
            metrics.close(summary=ts.step >= r.steps)
        return result
