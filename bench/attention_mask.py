"""Attention over packed rows with document masks, on this CPU: what each path costs.

    python bench/attention_mask.py [--seqs 4096 16384 --heads 4 --kv-heads 1 --head-dim 64]

Paths, each on the same q, k, v (batch 1, grouped-query heads) and the same documents:

- ``causal``: plain causal SDPA without the documents: the reference every ratio is taken to
  (the ceiling of SDPA; it attends across documents, which the mask forbids).
- ``dense``: SDPA with the additive ``(B, 1, T, T)`` document mask (models/layers.py: the CPU
  path of ``document_mask``), forward, and backward up to ``--bwd-max-seq`` (4k: on 2 cores one
  16k backward of causal SDPA took nearly three minutes, the masked one over four).
- ``flex``: compiled ``flex_attention`` with the document ``BlockMask`` (the CUDA path; here
  inductor's CPU kernel, which skips blocks outside every document), forward only: on CPU
  (torch 2.13) flex_attention has no backward. Its first call compiles (seconds), untimed.
  ``--eager-flex`` adds eager flex_attention, which computes the whole score matrix.

Each path runs in a fresh subprocess. Peak memory is the mask's bytes plus how far the RSS
high-water mark rose over the RSS before the timed calls (reset after warm-up and compilation;
tracemalloc does not see torch's allocations). Tokens/s: the row's tokens per second of one
attention layer (batch 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

EOT = 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Restart the RSS high-water mark (Linux: ``clear_refs`` 5), so compilation and warm-up
    before it do not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _documents(T: int, mean: int, seed: int):
    """Token ids ``(1, T)`` whose documents (ending in EOT) have random lengths around ``mean``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, 100, (1, T), generator=g)
    pos = -1
    while True:
        pos += int(torch.randint(mean // 4, 2 * mean, (1,), generator=g))
        if pos >= T:
            break
        idx[0, pos] = EOT
    return idx


def run_case(path: str, T: int, a) -> dict:
    """Forward, then (where the path has one) forward and backward. Peak memory of each: the
    mask's bytes plus the growth of the RSS high-water mark during the timed calls."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from allhands.models.layers import document_mask

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    q = torch.randn(1, a.heads, T, a.head_dim)
    k = torch.randn(1, a.kv_heads, T, a.head_dim)
    v = torch.randn(1, a.kv_heads, T, a.head_dim)
    idx = _documents(T, a.doc_len, seed=1)
    gqa = a.heads != a.kv_heads
    mask_bytes = 0
    if path == "causal":
        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif path == "dense":
        _, mask = document_mask(idx, EOT, path="sdpa")
        mask_bytes = mask.nbytes

        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        _, block = document_mask(idx, EOT, path="flex")
        mask_bytes = sum(t.nbytes for t in block.as_tuple() if isinstance(t, torch.Tensor))
        flex = flex_attention if path == "flex-eager" else torch.compile(flex_attention)

        def fn(q, k, v):
            return flex(q, k, v, block_mask=block, enable_gqa=gqa)

    def measure(backward: bool) -> dict:
        args = [t.detach().requires_grad_(backward) for t in (q, k, v)]

        def step():
            if backward:
                fn(*args).sum().backward()
            else:
                with torch.no_grad():
                    fn(*args)

        reps = a.reps if T <= 4096 else 1
        if not backward:
            step()  # warm-up (and compilation); the forward warms the backward's kernels too
        _reset_peak()
        before = _rss_bytes()
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        dt = (time.perf_counter() - t0) / reps
        peak = _peak_bytes() - before + mask_bytes
        return {"tok_s": T / dt, "ms": dt * 1e3, "peak_mib": peak / 2**20}

    out = {"fwd": measure(False)}
    # flex_attention has no backward on CPU (torch 2.13); SDPA's CPU backward took minutes at 16k
    if path in ("causal", "dense") and T <= a.bwd_max_seq:
        out["bwd"] = measure(True)
    return out


def _spawn(path: str, T: int, a) -> dict:
    cmd = [sys.executable, __file__, "--case", path, str(T),
           "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim),
           "--doc-len", str(a.doc_len), "--threads", str(a.threads), "--reps", str(a.reps),
           "--bwd-max-seq", str(a.bwd_max_seq)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.case_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"fwd": {"error": f"over {a.case_timeout}s"}}
    if p.returncode:
        return {"fwd": {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--doc-len", type=int, default=512, help="mean document length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bwd-max-seq", type=int, default=4096,
                    help="time backward up to this length (at 16k SDPA's CPU backward takes minutes)")
    ap.add_argument("--case-timeout", type=int, default=150)
    ap.add_argument("--eager-flex", action="store_true",
                    help="add eager flex_attention (the whole score matrix; 16 GiB at 16k)")
    ap.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print(json.dumps(run_case(a.case[0], int(a.case[1]), a)))
        return
    paths = ["causal", "dense", "flex"] + (["flex-eager"] if a.eager_flex else [])
    print(f"attention, one layer, B=1, heads {a.heads}/{a.kv_heads}, head_dim {a.head_dim}, "
          f"documents ~{a.doc_len} tokens, {a.threads} threads (torch CPU)")
    print(f"{'T':>6} {'path':<11} {'fwd tok/s':>10} {'x causal':>9} {'MiB':>7}   "
          f"{'fwd+bwd tok/s':>13} {'x causal':>9} {'MiB':>7}")
    for T in a.seqs:
        rows = {path: _spawn(path, T, a) for path in paths}
        base = rows["causal"]
        for path, r in rows.items():
            cells = [_cell(r.get("fwd"), base.get("fwd"), 10), _cell(r.get("bwd"), base.get("bwd"), 13)]
            print(f"{T:>6} {path:<11} {cells[0]}   {cells[1]}", flush=True)


def _cell(r: dict | None, ref: dict | None, width: int) -> str:
    """tokens/s, its ratio to the causal ceiling and the peak MiB of one case."""
    if r is None:
        return f"{'-':>{width}} {'':>9} {'':>7}"
    if "error" in r:
        return f"{r['error'][:width + 17]:>{width + 18}}"
    ratio = r["tok_s"] / ref["tok_s"] if ref and "tok_s" in ref else float("nan")
    return f"{r['tok_s']:>{width}.0f} {ratio:>9.2f} {r['peak_mib']:>7.0f}"


if __name__ == "__main__":
    main()
