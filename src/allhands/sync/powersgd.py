"""PowerSGD's memory through a checkpoint: error feedback, warm-started Q, counters, RNG.

torch's ``powerSGD_hook`` (Vogels et al. 2019, arXiv:1905.13727) keeps, per DDP bucket index,
- ``error_dict[b]``: this rank's compression residual, (bucket numel,): added to the next
  step's gradient (error feedback); it differs per rank;
- ``q_memory_dict[b]``: the Q factors of the bucket's compressed matrices, concatenated,
  (sum m_i r_i,): the next step starts its power iteration from them (warm start); identical on
  every rank after the hook's all-reduce. ``p_memory_dict[b]`` is recomputed from Q before use;
- ``iter`` (when compression starts), a NumPy ``RandomState`` (Q's first random draw) and the
  compression counters.
A resume without them restarts error feedback from zero and Q from random: not the run that was
interrupted. ``PowerSGDState.__getstate__`` would pickle the dicts as they are, but they are
keyed by bucket index, and DDP rebuilds its buckets in gradient-ready order after the first
backward of every process, so the resumed run's first step sees other buckets than the step
that saved. Here each bucket's tensors are cut per parameter instead (residual as the
parameter's shape, Q as (m, r) for the parameter viewed as an n x m matrix), which is
independent of the bucket layout and of the number of buckets: per element, PowerSGD's
arithmetic does not depend on which bucket a parameter sits in, so the resume is bit-exact.

Keys under ``sync.powersgd``: ``q_r<r>.<fqn>`` (r = the approximation rank, which sets Q's
shape) and the scalars once for all ranks (DCP keeps one copy of identical keys);
``error.rank<R>.<fqn>`` per rank of the DDP group. A rank that did not exist when the checkpoint
was saved starts with a zero residual; all ranks load the same Q, or, after a change of
``sync.powersgd_rank``, all draw a new one from the restored RNG (the residuals, gradient-shaped,
still apply).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression",
             "next_stats_report")


class PowerSGDMemory:
    """Owns a ``PowerSGDState`` and wraps ``powerSGD_hook`` so its state can be checkpointed."""

    def __init__(self, state: psgd.PowerSGDState, model: nn.Module):
        self.state = state
        self.rank = dist.get_rank(state.process_group)
        self.params = dict(model.named_parameters())  # the DDP-wrapped module's, plain names
        self._name = {id(p): k for k, p in self.params.items()}
        # bucket index -> ([(fqn, offset in the bucket, numel, shape)], {fqn: (q offset, m, r)},
        # total P numel), as of the bucket's last compressed step
        self.layouts: dict[int, tuple[list, dict, int]] = {}
        self._pending_error: dict[str, torch.Tensor] = {}
        self._pending_q: dict[str, torch.Tensor] = {}
        self._restore_keys: set[str] | None = None
        self._called: set[int] = set()  # bucket indices already run in the current step

    # -- the hook
    def hook(self, state: psgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future:
        if state.iter >= state.start_powerSGD_iter:  # the compressed path
            idx = bucket.index()
            layout = self._layout(bucket)
            if idx in self.layouts and self.layouts[idx][0] != layout[0]:
                # DDP rebuilt its buckets (after the first backward of a process, also of a
                # resumed one): the dicts' entries no longer match their bucket index.
                self._to_pending()
            self.layouts[idx] = layout
            self._called.add(idx)
            if self._pending_error or self._pending_q:
                self._restore(idx, bucket.buffer(), layout)
        if bucket.is_last():  # DDP waits for every bucket before backward returns
            self._called = set()
        return psgd.powerSGD_hook(state, bucket)

    def _to_pending(self) -> None:
        """Cut the entries of buckets not yet run in this step (whose futures are therefore
        done) into per-parameter tensors, restored by each parameter's next bucket. A bucket
        already run in this step has its new layout recorded and keeps its entry."""
        st = self.state
        for idx in [i for i in self.layouts if i not in self._called]:
            entries, qlay, _ = self.layouts.pop(idx)
            if idx in st.error_dict:
                err = st.error_dict.pop(idx)
                for name, off, numel, shape in entries:
                    self._pending_error[name] = err[off:off + numel].view(shape).clone()
            q = st.q_memory_dict.pop(idx, None)
            st.p_memory_dict.pop(idx, None)
            if q is not None:
                for name, (off, m, r) in qlay.items():
                    self._pending_q[name] = q[off:off + m * r].view(m, r).clone()

    def _layout(self, bucket: dist.GradBucket) -> tuple[list, dict, int]:
        """Where each parameter's gradient sits in the bucket buffer, and its Q slice in the
        hook's Q memory: matrices grouped by shape in first-seen order (powerSGD_hook's
        ``shape_to_tensors``), each group's tensors in bucket order."""
        buf = bucket.buffer()
        entries, groups = [], {}
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            name = self._name[id(p)]
            entries.append((name, (g.data_ptr() - buf.data_ptr()) // g.element_size(), g.numel(),
                            tuple(g.shape)))
            compressed = _q_shape(g.shape, self.state)
            if compressed is not None:
                groups.setdefault((g.shape[0], compressed[0]), []).append((name, *compressed))
        q, off, total_p = {}, 0, 0
        for (n, _), items in groups.items():
            for name, m, r in items:
                q[name] = (off, m, r)
                off += m * r
                total_p += n * r
        return entries, q, total_p

    def _restore(self, idx: int, buf: torch.Tensor, layout: tuple[list, dict, int]) -> None:
        """Before the bucket's first compressed step after a load: rebuild its residual and Q
        memory in this process's bucket layout from the per-parameter tensors."""
        entries, q, total_p = layout
        st = self.state
        if st.use_error_feedback and any(name in self._pending_error for name, *_ in entries):
            err = torch.zeros(buf.numel(), dtype=buf.dtype, device=buf.device)
            for name, off, numel, _ in entries:
                if name in self._pending_error:
                    err[off:off + numel].copy_(self._pending_error.pop(name).reshape(-1))
            st.error_dict[idx] = err
        if st.warm_start and q and all(name in self._pending_q for name in q):
            mem = torch.empty(sum(m * r for _, m, r in q.values()), dtype=buf.dtype, device=buf.device)
            for name, (off, m, r) in q.items():
                mem[off:off + m * r].copy_(self._pending_q.pop(name).reshape(-1))
            st.q_memory_dict[idx] = mem
            st.p_memory_dict[idx] = torch.empty(total_p, dtype=buf.dtype, device=buf.device)

    # -- checkpoint
    def saved_keys(self, keys: set[str]) -> None:
        self._restore_keys = {k[len("sync.powersgd."):] for k in keys if k.startswith("sync.powersgd.")}

    def state_dict(self) -> dict[str, Any]:
        st = self.state
        out: dict[str, Any] = {k: torch.tensor(getattr(st, k), dtype=torch.int64) for k in _COUNTERS}
        _, keys, pos, has_gauss, gauss = st.rng.get_state()
        out["rng_keys"] = torch.from_numpy(keys.astype(np.int64))
        out["rng_rest"] = torch.tensor([pos, has_gauss, gauss], dtype=torch.float64)
        mine = f"rank{self.rank}"
        if self._restore_keys is not None:
            # Targets to load into, only what the checkpoint has (a run saved without PowerSGD
            # has none: it starts fresh), the tensors shaped from the parameters.
            have = self._restore_keys
            out = {k: v for k, v in out.items() if k in have}
            out["error"] = {mine: {k: torch.zeros_like(p) for k, p in self.params.items()
                                   if f"error.{mine}.{k}" in have}}
            out[self._q_key()] = {k: torch.zeros(_q_shape(p.shape, st), dtype=p.dtype, device=p.device)
                                  for k, p in self.params.items() if f"{self._q_key()}.{k}" in have}
            return out
        error, q = {}, {}
        for idx, (entries, qlay, _) in self.layouts.items():
            if idx in st.error_dict:
                for name, off, numel, shape in entries:
                    error[name] = st.error_dict[idx][off:off + numel].view(shape).clone()
            if idx in st.q_memory_dict:
                for name, (off, m, r) in qlay.items():
                    q[name] = st.q_memory_dict[idx][off:off + m * r].view(m, r).clone()
        for name, t in self._pending_error.items():  # loaded or cut, not yet run again
            error.setdefault(name, t)
        for name, t in self._pending_q.items():
            q.setdefault(name, t)
        out["error"], out[self._q_key()] = {mine: error}, q
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        st = self.state
        self._restore_keys = None
        for k in _COUNTERS:
            if k in sd:
                setattr(st, k, int(sd[k]))
        if "rng_keys" in sd:
            pos, has_gauss, gauss = sd["rng_rest"].tolist()
            st.rng.set_state(("MT19937", sd["rng_keys"].numpy().astype(np.uint32), int(pos),
                              int(has_gauss), float(gauss)))
        # Applied at each bucket's next compressed step (see hook); until then the dicts are
        # empty, as in a fresh process.
        st.error_dict.clear()
        st.p_memory_dict.clear()
        st.q_memory_dict.clear()
        self._pending_error = dict(sd.get("error", {}).get(f"rank{self.rank}", {}))
        self._pending_q = dict(sd.get(self._q_key(), {}))

    def _q_key(self) -> str:
        return f"q_r{self.state.matrix_approximation_rank}"


def _q_shape(shape: torch.Size | tuple, state: psgd.PowerSGDState) -> tuple[int, int] | None:
    """(m, r) of the Q factor of a gradient of ``shape`` viewed as an n x m matrix, or None when
    powerSGD_hook sends it uncompressed (its ``_should_compress`` rule)."""
    if len(shape) == 0:
        return None
    n = shape[0]
    m = int(torch.Size(shape).numel()) // n if n else 0
    r = min(n, m, state.matrix_approximation_rank)
    if not psgd._should_compress(n, m, r, state.min_compression_rate)[0]:
        return None
    return m, r

