"""The peak MFU is measured against: the datasheet table read by the names torch gives the GPUs
(the longest, whole-word key wins), and ``log.peak_tflops``, which wins for any device."""

from __future__ import annotations

import json

import pytest
import torch

from allhands.config import ConfigError, load_config, validate
from allhands.flops import PEAK_FLOPS, StepFlops, accelerator_peak, peak_flops
from allhands.job import build_reference_model, lm_loss
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config

T = 1e12


@pytest.mark.parametrize("name, bf16, fp32", [
    ("NVIDIA H100 80GB HBM3", 989 * T, 67 * T),
    ("NVIDIA H100 NVL", 835 * T, 60 * T),
    ("NVIDIA H100 PCIe", 756 * T, 51 * T),
    ("NVIDIA H800", 989 * T, 67 * T),
    ("NVIDIA H800 PCIe", 756 * T, 51 * T),
    ("NVIDIA H200", 989 * T, 67 * T),
    ("NVIDIA H200 NVL", 835 * T, 60 * T),
    ("NVIDIA GH200 480GB", 989 * T, 67 * T),
    ("NVIDIA B200", 2250 * T, 75 * T),
    ("NVIDIA GB200", 2500 * T, 80 * T),
    ("NVIDIA A100-SXM4-80GB", 312 * T, 19.5 * T),
    ("NVIDIA A100 80GB PCIe", 312 * T, 19.5 * T),
    ("NVIDIA A10", 125 * T, 31.2 * T),
    ("NVIDIA L4", 121 * T, 30.3 * T),
    ("NVIDIA L40S", 362 * T, 91.6 * T),
    ("AMD Instinct MI300X", 1307.4 * T, 163.4 * T),
    ("AMD Instinct MI325X", 1307.4 * T, 163.4 * T),
])
def test_the_table_reads_names_as_torch_reports_them(name, bf16, fp32):
    assert (accelerator_peak(name, "bf16"), accelerator_peak(name, "fp32")) == (bf16, fp32)


@pytest.mark.parametrize("name", ["Tesla T4", "NVIDIA A10G", "NVIDIA L40", "NVIDIA GeForce RTX 4090"])
def test_a_part_the_table_does_not_know_has_no_peak(name):
    """Not the peak of a name inside its own (A10 in A10G, L4 in L40): none, and no MFU."""
    assert accelerator_peak(name, "bf16") is None


def test_the_plan_presets_keys_are_in_the_table():
    assert {"A100", "H100", "H200"} <= set(PEAK_FLOPS)


def test_a_cuda_device_is_looked_up_by_its_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    assert peak_flops(torch.device("cuda", 0), "bf16", 1) == (835 * T, "datasheet NVIDIA H100 NVL")


def test_the_override_wins_for_any_device_and_nothing_is_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("ALLHANDS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    assert peak_flops(torch.device("cuda", 0), "bf16", 1, 500.0) == (500 * T, "log.peak_tflops")
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.seq_len=8"])
    x = torch.randint(0, 50, (2, 8))
    barriers = []
    flops = StepFlops.start(lambda: build_reference_model(cfg, 50), (x, x), lm_loss, global_batch=2,
                            device=torch.device("cpu"), bf16=False, threads=1, devices=2, leader=True,
                            barrier=lambda: barriers.append(1), peak_tflops=0.5)
    assert flops.peak == 0.5 * T and flops.raise_peak is None and not barriers
    assert not (tmp_path / "gemm_peak.json").exists()  # no CPU GEMM measured
    assert "0.5 TFLOP/s per device (log.peak_tflops)" in flops.describe()
    got = flops.fields(step_time=2.0)
    assert got["mfu"] == pytest.approx(flops.per_step / 2.0 / 2 / (0.5 * T))


def test_a_negative_override_names_the_field():
    with pytest.raises(ConfigError, match=r"^log\.peak_tflops: -1\.0 is not allowed"):
        validate(load_config(None, ["log.peak_tflops=-1"]), need_data=False)


def test_a_run_measures_mfu_against_the_override(token_dir, tmp_path):
    run_dir = tmp_path / "run"
    train_job(tiny_config(token_dir, run_dir, "run.steps=2", "log.peak_tflops=1000"), LaunchSpec(nproc=1))
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "mfu" in r]
    assert steps and all(r["mfu"] == pytest.approx(r["achieved_flops"] / 1e15) for r in steps)
