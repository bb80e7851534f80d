"""FLOPs and MFU: torch's counter on the reference GPT equals the analytic formula, the CPU peak
is measured once per machine, and every logged step carries achieved FLOP/s and MFU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from allhands.config import Config, apply_override
from allhands.flops import (StepFlops, accelerator_peak, count_flops, cpu_gemm_peak, gpt_flops_per_token,
                            raise_cpu_gemm_peak)
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.job import build_reference_model, lm_loss

from conftest import tiny_config


@pytest.mark.parametrize("shape", [
    dict(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=257, tie_embeddings=True, bias=False),
    dict(n_layer=3, n_head=4, n_embd=64, seq_len=48, vocab_size=1000, tie_embeddings=False, bias=True),
])
def test_reference_gpt_flop_count_equals_analytic_formula(shape):
    cfg = Config()
    for k, v in shape.items():
        apply_override(cfg, f"model.{k}={str(v).lower()}")
    batch, t = 3, shape["seq_len"]
    x = torch.randint(0, shape["vocab_size"], (batch, t))
    counted = count_flops(lambda: build_reference_model(cfg, shape["vocab_size"]), x, x, lm_loss)
    analytic = gpt_flops_per_token(n_layer=shape["n_layer"], n_embd=shape["n_embd"], seq_len=t,
                                   vocab_size=shape["vocab_size"])
    assert counted == analytic * batch * t


def test_accelerator_peak_table_matches_names_as_torch_reports_them():
    assert accelerator_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert accelerator_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert accelerator_peak("NVIDIA H200", "fp32") == 67e12
    assert accelerator_peak("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert accelerator_peak("Tesla T4", "bf16") is None


def test_cpu_gemm_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ALLHANDS_CACHE_DIR", str(tmp_path))
    assert cpu_gemm_peak(1, measure=False) is None
    peak = cpu_gemm_peak(1)
    assert peak > 1e8  # any CPU of this century does > 0.1 GFLOP/s in one thread
    assert (tmp_path / "gemm_peak.json").is_file()
    assert cpu_gemm_peak(1, measure=False) == peak == cpu_gemm_peak(1)


def test_a_step_above_the_cached_peak_raises_it_and_mfu_never_exceeds_1(tmp_path, monkeypatch):
    """A peak cached under load (here far too low) is measured again once a run beats it; the cache
    keeps the maximum, and MFU stays <= 1 (clamped, with the raw value, where nothing can raise it)."""
    monkeypatch.setenv("ALLHANDS_CACHE_DIR", str(tmp_path))
    (tmp_path / "gemm_peak.json").write_text("{}")
    low = 1e6
    assert raise_cpu_gemm_peak(1, "fp32", low) > 1e8  # a real measurement, cached
    cache = tmp_path / "gemm_peak.json"
    table = json.loads(cache.read_text())
    real = next(iter(table.values()))
    table = {k: low for k in table}  # as if measured under heavy load
    cache.write_text(json.dumps(table))
    assert cpu_gemm_peak(1) == low
    calls = []
    flops = StepFlops(per_step=int(4e6), peak=low, devices=2,
                      raise_peak=lambda a: calls.append(a) or raise_cpu_gemm_peak(1, "fp32", a))
    got = flops.fields(1.0)  # 2e6 FLOP/s per worker: twice the cached peak
    assert calls == [2e6] and got["peak_raised"] == flops.peak > 0.1 * real
    assert got["mfu"] == pytest.approx(2e6 / flops.peak) and got["mfu"] <= 1
    assert cpu_gemm_peak(1) == flops.peak  # cached
    raise_cpu_gemm_peak(1, "fp32", 1.0)  # a lower measurement never lowers the cache
    assert cpu_gemm_peak(1) >= flops.peak
    assert "peak_raised" not in flops.fields(1.0)  # once per run
    gpu = StepFlops(per_step=int(3e12), peak=1e12, devices=1)  # a datasheet peak: nothing to raise
    clamped = gpu.fields(1.0)
    assert clamped["mfu"] == 1.0 and clamped["mfu_clamped"] == pytest.approx(3.0)


def test_mfu_appears_in_metrics(token_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ALLHANDS_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_config(token_dir, tmp_path / "run")
    done = train_job(cfg, LaunchSpec(nproc=2))
    rows = [json.loads(x) for x in (Path(done.run.dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    m = cfg.model
    per_token = gpt_flops_per_token(n_layer=m.n_layer, n_embd=m.n_embd, seq_len=m.seq_len, vocab_size=257)
    for r in steps:
        assert r["flops_per_step"] == per_token * m.seq_len * cfg.run.global_batch
        assert r["achieved_flops"] == pytest.approx(r["flops_per_step"] / r["step_time"])
        assert 0 < r["mfu"] < 1
    assert (tmp_path / "cache" / "gemm_peak.json").is_file()  # measured by the node's rank 0
