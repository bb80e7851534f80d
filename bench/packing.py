"""Document-masked packing against padding each document to seq_len, on the embedded corpus.

Both train the same small Llama (1 process, 1 thread) on rows of whole documents of the embedded
corpus: ``data.packing=mask`` packs several documents into each row (document masks keep them
apart), ``pad`` gives each document a row of its own. What counts is the tokens that carry loss
(targets not ignored) per second, timed in alternating rounds in one run. Also prints the
corpus's document-length distribution, which decides the ratio.

    python bench/packing.py [--seq-len 512] [--batch 4] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from allhands.data.packing import IGNORE
from allhands.data.shards import load_meta, load_token_splits, prepare_embedded
from allhands.models.llama import Llama, LlamaConfig


def rate(model, ds, batch: int, steps: int, opt) -> float:
    """Loss-carrying target tokens per second over ``steps`` steps of ``batch`` rows."""
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(ds), generator=g)
    useful, t0 = 0, time.perf_counter()
    for s in range(steps):
        rows = [ds[int(i)] for i in order[s * batch:(s + 1) * batch]]
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        useful += int((y != IGNORE).sum())
    return useful / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    data = prepare_embedded(Path(tempfile.gettempdir()) / "allhands-bench-corpus")
    eot = int(load_meta(data)["eot"])
    sets = {k: load_token_splits(data, a.seq_len, k)[0] for k in ("mask", "pad")}
    pad = sets["pad"]
    lengths = np.array([int(pad.rows[0][i][1]) for i in range(len(pad.rows[0]))])
    print(f"documents: {len(lengths)} rows of one document; tokens per document median "
          f"{int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, max {lengths.max()} "
          f"(rows of {a.seq_len + 1} tokens; longer documents fill several)")
    print(f"rows: mask {len(sets['mask'])}, pad {len(pad)}")
    rates: dict[str, list[float]] = {"mask": [], "pad": []}
    for _ in range(a.rounds):
        for kind in ("mask", "pad"):  # alternating, so load hits both alike
            torch.manual_seed(0)
            model = Llama(LlamaConfig(vocab_size=257, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                      seq_len=a.seq_len, doc_token=eot if kind == "mask" else -1))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            rates[kind].append(rate(model, sets[kind], a.batch, a.steps, opt))
    for kind, r in rates.items():
        print(f"{kind}: loss-carrying tokens/s per round {', '.join(f'{v:,.0f}' for v in r)}")
    m, p = statistics.median(rates["mask"]), statistics.median(rates["pad"])
    print(f"mask / pad, loss-carrying tokens/s: {m / p:.2f}")


if __name__ == "__main__":
    main()
