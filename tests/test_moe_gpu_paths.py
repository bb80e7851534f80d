"""The MoE layer's CUDA path, seen from a CPU-only build: under every ZeRO stage's bf16 the
routed experts take ``torch._grouped_mm`` (one kernel), and the layer's forward never waits on
the host.

CUDA tensors exist here only as fake tensors (``FakeTensorMode``: shapes, dtypes and devices,
no data). That is also the host-sync detector: an op whose result the host must read
(``.item()``, ``.tolist()``, ``int(t)``, ``nonzero``, ``bincount``'s output size) raises under
it. CUDA autocast cannot be entered through ``torch.autocast`` on this build (it warns and
disables itself), but ``torch.set_autocast_enabled("cuda", True)`` switches it on, and fake
CUDA tensors go through its casts. Forward only, without autograd: a fake CUDA tensor that
requires grad makes autograd ask for a CUDA device guard, and on a CPU-only build that aborts
the process (torch 2.13)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode)
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from allhands.models import moe as moe_mod
from allhands.models.moe import MoE, MoEArgs, compute_dtype, takes_grouped_kernel
from allhands.parallel.layout import choose_precision

DIM, HIDDEN = 16, 32  # multiples of 8: _grouped_mm's 16-byte alignment in bf16


@contextlib.contextmanager
def cuda_autocast(on: bool):
    """bf16 CUDA autocast on this build (``torch.autocast("cuda")`` refuses without a GPU)."""
    before, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", on)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", before)
        torch.set_autocast_dtype("cuda", dtype)


class RowGathers(TorchFunctionMode):
    """``t[index]`` as ``t.index_select(0, index)``, the same gather: Python indexing of a fake
    CUDA tensor takes a C++ device guard that a CPU-only build lacks ("not linked with support
    for cuda devices"). Only long 1-D indices: a boolean mask, which syncs, is left to fail."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            t, index = args
            if isinstance(index, torch.Tensor) and index.dtype == torch.long and index.dim() == 1:
                return t.index_select(0, index)
        return func(*args, **(kwargs or {}))


def stage_dtypes(zero: int) -> tuple[torch.dtype, bool]:
    """(the parameters' dtype in forward, autocast on) of ``run.precision=bf16`` on CUDA under
    ZeRO ``zero``, from the layout's own choice: autocast over fp32 parameters under 0/1,
    FSDP's bf16 parameters (and inputs) under 2/3."""
    prec = choose_precision("bf16", "cuda", zero, "fp32")
    return prec.param_dtype or torch.float32, prec.autocast


def _layer(**moe) -> MoE:
    torch.manual_seed(0)
    m = MoE(DIM, 48, MoEArgs(n_experts=4, top_k=2, hidden=HIDDEN, **moe))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m.train()


@pytest.fixture
def spied(monkeypatch):
    """Counts ``torch._grouped_mm`` calls; the padded fallback fails the test."""
    calls = []
    real = torch._grouped_mm

    def grouped(*a, **kw):
        calls.append((a[0].dtype, a[1].dtype))
        return real(*a, **kw)

    def padded(*a, **kw):
        raise AssertionError("the padded fallback ran (one host sync per expert GEMM)")

    monkeypatch.setattr(torch, "_grouped_mm", grouped)
    monkeypatch.setattr(moe_mod, "padded_mm", padded)
    return calls


def _fake_forward(layer: MoE, dtype: torch.dtype, autocast: bool) -> torch.Tensor:
    """Forward of ``layer`` in training mode on fake CUDA tensors: its parameters and its input
    in ``dtype``, under bf16 autocast or not."""
    with FakeTensorMode():
        state = {}
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            param = isinstance(t, torch.nn.Parameter)
            state[name] = torch.empty(t.shape, dtype=dtype if param else t.dtype, device="cuda")
        x = torch.empty(2, 8, DIM, device="cuda", dtype=dtype)
        with cuda_autocast(autocast), RowGathers():
            return functional_call(layer, state, (x,))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_zero_stage_takes_the_grouped_kernel_without_a_host_sync(spied, zero):
    dtype, autocast = stage_dtypes(zero)
    assert (dtype, autocast) == ((torch.float32, True) if zero < 2 else (torch.bfloat16, False))
    out = _fake_forward(_layer(n_shared=1), dtype, autocast)
    assert spied == [(torch.bfloat16, torch.bfloat16)] * 3  # gate, up, down: one kernel each
    assert out.device.type == "cuda" and out.dtype == dtype  # the residual stream's dtype


@pytest.mark.parametrize("balance", ["aux", "bias"])
def test_routing_and_balancing_read_nothing_on_the_host(spied, balance):
    out = _fake_forward(_layer(balance=balance, score="sigmoid"), torch.float32, True)
    assert out.shape == (2, 8, DIM)


def test_the_detector_sees_a_host_sync():
    """The fake-tensor check is no tautology: fp32 experts outside autocast take the padded
    fallback, whose row positions (``repeat_interleave`` by the counts) and padded length
    (``int(counts.max())``) the host must read, and that raises here."""
    layer = _layer()
    with pytest.raises((DynamicOutputShapeException, DataDependentOutputException)):
        _fake_forward(layer, torch.float32, False)


def test_the_decision_reads_autocast_not_the_tensor_dtype():
    x, w = torch.empty(8, DIM), torch.empty(4, HIDDEN, DIM)
    assert compute_dtype(x) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(x) == torch.bfloat16
    with FakeTensorMode():
        xc, wc = torch.empty(8, DIM, device="cuda"), torch.empty(4, HIDDEN, DIM, device="cuda")
        assert not takes_grouped_kernel(xc, wc)  # fp32: the fallback
        assert takes_grouped_kernel(xc.bfloat16(), wc.bfloat16())
        assert not takes_grouped_kernel(xc.bfloat16().narrow(1, 0, 12),
                                        wc.bfloat16().narrow(2, 0, 12))  # misaligned rows
        with cuda_autocast(True):
            assert compute_dtype(xc) == torch.bfloat16
    assert not takes_grouped_kernel(x.bfloat16(), w.bfloat16())  # CPU: no backward for _grouped_mm


def test_cpu_autocast_runs_the_layer_in_bf16_and_fp32_stays_exact(monkeypatch):
    """On CPU the same casts run for real (the padded fallback, in bf16): the layer under
    ``torch.autocast("cpu")`` with fp32 parameters (ZeRO-0/1's bf16) trains and stays near fp32,
    and without autocast the layer is its one-expert-at-a-time reference to rounding."""
    layer = _layer(n_shared=1)
    x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(1))
    want = layer(x)
    seen = []
    real = moe_mod.padded_mm

    def padded(a, w, c):
        seen.append((a.dtype, w.dtype))
        return real(a, w, c)

    monkeypatch.setattr(moe_mod, "padded_mm", padded)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)  # before the change: index_add refused the bf16 expert rows
        got.sum().backward()
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert got.dtype == torch.float32 and layer.experts.gate_proj.grad.dtype == torch.float32
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)
    flat = x.reshape(-1, DIM)
    w, idx, _ = layer.router(flat)
    order = torch.argsort(idx.reshape(-1), stable=True)
    counts = torch.bincount(idx.reshape(-1), minlength=4)
    ys = layer.experts.reference(flat[order // 2], counts) * w.reshape(-1)[order].unsqueeze(1)
    ref = torch.zeros_like(flat).index_add(0, order // 2, ys) + moe_mod.swiglu(layer.shared, flat)
    assert torch.allclose(want.reshape(-1, DIM), ref, atol=1e-6)
