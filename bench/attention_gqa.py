"""Grouped-query attention on CPU: SDPA's own ``enable_gqa`` broadcasting against expanding k and
v to every query head first (``repeat_interleave``, transformers' ``repeat_kv``), forward and
backward, at a Llama-3-like head ratio (32 query heads over 8 kv heads, head_dim 64).

    python bench/attention_gqa.py [--batch 4 --seq 256 --reps 20]

Prints the median milliseconds of each and their ratio. Model code uses whichever is faster
(models/layers.py: Attention).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _time(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, requires_grad=True)
    k = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, requires_grad=True)
    v = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, requires_grad=True)
    rep = a.heads // a.kv_heads

    def gqa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def repeat():
        kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        F.scaled_dot_product_attention(q, kk, vv, is_causal=True).sum().backward()

    with torch.no_grad():
        same = (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                - F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                 v.repeat_interleave(rep, 1), is_causal=True)).abs().max()
    ta, tb = _time(gqa, a.reps), _time(repeat, a.reps)
    print(f"attention fwd+bwd B={a.batch} T={a.seq} heads={a.heads}/{a.kv_heads} hd={a.head_dim} "
          f"threads={a.threads}: enable_gqa {ta:.2f} ms, repeat_kv {tb:.2f} ms, "
          f"repeat/gqa {tb / ta:.2f} (max diff {same:.1e})")


if __name__ == "__main__":
    main()
