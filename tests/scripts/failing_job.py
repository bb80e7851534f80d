"""A user job whose rank 1 raises in forward at step 7 (after the step-5 checkpoint)."""

import sys

import torch
import torch.nn as nn

import allhands


class Flaky(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.rank, self.calls = rank, 0

    def forward(self, x):
        self.calls += 1
        if self.rank == 1 and self.calls == 7:
            raise ValueError("boom in rank 1's forward")
        return self.lin(x)


def data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


if __name__ == "__main__":

    rank = int(__import__("os").environ["RANK"])
    cfg = allhands.load_config(overrides=[f"run.dir={sys.argv[1]}", "run.steps=20", "run.global_batch=8",
                                          "checkpoint.interval=5", "log.progress=false"])
    allhands.train(cfg, model=lambda c: Flaky(rank), data=data, loss=nn.functional.mse_loss)
