"""The sparse benchmark's DLRM-style click model and its generated data (bench/ps.py): one
EmbeddingBag table (over 99% of the parameters) summed over 8 categorical fields, a small MLP
on top, and clicks drawn from a planted logistic model over Zipf-like ids (Naumov et al. 2019,
DLRM, without the dense features). The straggler benchmark runs the same model with a fixed
"device time" per training step (``DeviceTimed``, ``RandomStraggler``), the server benchmark a
wide model whose workers only sleep and move parameters (``WideModel``)."""

from __future__ import annotations

import os
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROWS, DIM, FIELDS = 20_000, 16, 8


class ClickModel(nn.Module):
    def __init__(self, device: str | None = None):
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", device=device)
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(x)).squeeze(-1)


def model(cfg) -> nn.Module:
    return ClickModel()


def _samples(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = (torch.rand(n, FIELDS, generator=g) ** 3 * ROWS).long()  # a few ids are hot, most rare
    w = torch.randn(ROWS, generator=torch.Generator().manual_seed(99))  # the planted click model
    p = torch.sigmoid(w[ids].sum(1) / FIELDS ** 0.5)
    return torch.utils.data.TensorDataset(ids, torch.bernoulli(p, generator=g))


def data(cfg):
    return _samples(20_000, 1), _samples(2_000, 2)


def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, y)


# The straggler benchmark's step: DEVICE_S seconds of "device time" (a sleep: the host's CPU is
# free meanwhile, as it is while an accelerator runs a step's kernels) plus the click model's
# small CPU forward/backward. DistBelief's workers are separate machines; 3 workers and a server
# on 2 shared cores would instead contend for CPU, and a sleeping straggler would hand its core
# to the others, so the ratio would measure the scheduler, not the algorithm.
DEVICE_S = 0.1


class DeviceTimed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ClickModel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(DEVICE_S)
        return self.inner(x)


def device_timed_model(cfg) -> nn.Module:
    return DeviceTimed()


# The seeded-random straggler: every step one worker, drawn by a generator seeded with the step,
# takes SLOW times the device time, the others DEVICE_S. Every worker draws the same one, so under
# DDP every step lasts SLOW * DEVICE_S, while an asynchronous worker's mean step is
# DEVICE_S * (1 + (SLOW - 1) / workers).
SLOW = 3


class RandomStraggler(nn.Module):
    def __init__(self, workers: int):
        super().__init__()
        self.inner, self.workers, self.steps = ClickModel(), workers, 0
        self.rank = int(os.environ.get("RANK", "0"))  # a worker's rank (ps: workers come first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:  # one forward per step (micro_batches = 1)
            self.steps += 1
            slow = random.Random(self.steps).randrange(self.workers) == self.rank
            time.sleep(DEVICE_S * (SLOW if slow else 1))
        return self.inner(x)


def random_straggler_model(cfg) -> nn.Module:
    return RandomStraggler(workers=3)


# The server benchmark's model: WIDE_PARAMS parameters in one wide hidden layer after the table,
# DEVICE_S of device time per step, and a CPU step that is small next to a server's update of
# all of them (receive the gradient, AdamW, send the parameters back).
WIDE = 2560


class WideModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(DIM, WIDE), nn.ReLU(), nn.Linear(WIDE, WIDE), nn.ReLU(),
                                 nn.Linear(WIDE, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(DEVICE_S)
        return self.mlp(self.emb(x)).squeeze(-1)


def wide_model(cfg) -> nn.Module:
    return WideModel()
