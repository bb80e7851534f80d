"""The reference of bench/startup.py: a plain torchrun script with a hand-written DDP loop (the
reference GPT, random tokens, AdamW, clipping), nothing else. Run by torchrun:

    torchrun --standalone --nproc-per-node 2 bench/raw_ddp.py --steps 35 --global-batch 16
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from allhands.models.gpt import GPT, GPTConfig  # noqa: E402  (a plain torch module)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=35)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(vocab_size=257, seq_len=a.seq, n_layer=a.layers, n_head=a.heads,
                              n_embd=a.width, dropout=0.0, bias=True, tie_embeddings=True)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(rank)
    for _ in range(a.steps):
        x = torch.randint(257, (a.global_batch // world, a.seq + 1), generator=g)
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
