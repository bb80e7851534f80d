"""Bring your own model and data: a small regression MLP trained data-parallel.

    allhands launch --nproc 2 examples/user_model.py --steps 50

The model is a plain nn.Module; the dataset a map-style dataset of (input, target) pairs.
"""

import argparse

import torch
import torch.nn as nn

import allhands


def build_model(cfg: allhands.Config) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def build_data(cfg: allhands.Config):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=g)
    y = (x @ torch.linspace(-1, 1, 8)).unsqueeze(1) + 0.01 * torch.randn(4096, 1, generator=g)
    return torch.utils.data.TensorDataset(x[:3584], y[:3584]), torch.utils.data.TensorDataset(x[3584:], y[3584:])


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--run-dir", default="runs/user-model")
    args = ap.parse_args()
    cfg = allhands.load_config(overrides=[f"run.steps={args.steps}", f"run.dir={args.run_dir}",
                                          "run.global_batch=64", "optim.lr=1e-2", "run.eval_interval=25"])
    result = allhands.train(cfg, model=build_model, data=build_data, loss=mse)
    if result:
        print(f"final loss {result['loss']:.4f}, eval loss {result.get('eval_loss', float('nan')):.4f}")
