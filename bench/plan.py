"""How close ``allhands plan`` comes: on this machine, and against published runs.

1. This machine. ``plan --check`` on a small reference GPT (``CHECKED``: tests/conftest.py's TINY
   made 4 blocks of width 128 over 64 tokens, 0.8M parameters) with 2 workers, so that the
   fastest layout's step (60-80 ms here) is mostly compute and communication: steps of 5-15 ms, as
   TINY's, are mostly the scheduler's noise on a shared 2-core machine. Every layout that fits is trained ``--steps`` steps through the launcher, ``--repeat``
   times, and its predicted peak memory and step time (``--cluster local``: composed from the
   machine's cached calibration, plan/calibrate.py, never from a measured step of the layout) are
   put beside the measured ones. Targets: peak memory within 10%, step time within 25% in every
   repeat. Step times are the fastest step after the first two, the statistic the calibration
   uses for its probes (other processes only add time); the median is shown beside it.

2. Published runs. Predicted MFU (so tokens/s) for configurations whose throughput was published,
   from the cluster presets (datasheet peaks, flops.py; link figures and each GPU generation's
   kernel terms, cluster.py's KERNELS) and what each source states about its hardware and
   software. The kernel terms (matmul share of peak and its fall for narrow matrices, fused
   attention's share, element-wise bandwidth share, FSDP overlap) are fitted per generation on
   the fitting half, every other row of each table (rows 0, 2, 4, ... as entered below: FIT_RULE);
   the other half is printed apart as held out, with each generation's spread of measured /
   predicted, the interval ``allhands plan`` prints. ``--fit`` fits the terms again and prints the
   comparison under them. Target: within 20% of published. The runs:

   - torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md``: Llama 3.1 8B, FSDP, local
     batch 2, sequence 8192, selective AC, bf16, on 8 and on 128 H100 (Tables 1 and 3):
     5,762 / 6,667 tokens/s per GPU on 8 (eager / torch.compile), 5,605 / 6,514 on 128. Its
     hardware section: 96 GB HBM2e at 2.4 TB/s, the default 500 W power limit; its footnote: the
     part's actual peak lies between the SXM's (989) and the NVL's (835 TFLOP/s), and the MFU it
     gives (33-39%) is taken against 989. Planned with ``hbm_gbs=2400`` at the geometric middle
     of the two peaks (the MFU against 989), both ends printed beside it.
   - torchtitan, ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``, the same 500 W parts:
     the vanilla-TP bf16 rows, Llama 3 8B on 64 H100 (FSDP 8, TP 8, compile, per-op selective AC,
     local batch 12: 4,378 tokens/s per GPU) and Llama 3 70B on 256 H100 (FSDP 32, TP 8, compile,
     full AC, local batch 16: 597.3); planned as the rows above.
   - llm-foundry, ``scripts/train/benchmarking/README.md`` (mosaicml/llm-foundry 061f2c7), table
     "H100 80GB BF16": all 52 rows, MPT 760M-70B (the reference GPT's shape; each row's NumParams
     is the planner's count, tests/test_plan_published.py), sequence 512-65,536, on 8-64 H100,
     Composer FSDP FULL_SHARD, amp_bf16, flash attention, their micro batch, accumulation and
     activation checkpointing; tokens/s per GPU as printed. Its interconnect is not stated: planned
     on the h100 preset (8 GPUs and one 400 Gb/s port each a node). The software as it ran: no
     dropout (MPT's config defaults) and flash-attn's fused cross-entropy, llm-foundry's default
     ``loss_fn`` (``loss="fused"``: bf16 logits and gradient, no fp32 copy).
   - llm-foundry, the same README, table "A100 80GB with 1600 Gbps node-node interconnect (RoCE)":
     all 61 rows, MPT 125M-70B, the same software; 59 amp_bf16 rows on one node of 8 A100 and the
     70B on 32 and 64 A100 in Composer's "PURE" FSDP mixed precision (gradients reduced in bf16:
     ``parallel.reduce_dtype=bf16``), planned on the a100 preset with 8 x 25 GB/s a node between
     nodes. Beside the H100 table it compares the same software on both parts.
   - torchtitan, docs/performance.md (2024): Llama 3 8B, FSDP2 on 64 A100 80 GB, local batch 1,
     selective layer / op AC: 2,904 / 2,973 tokens/s per GPU, MFU 56.8% / 58.2%.
   - Megatron-LM, Narayanan et al. SC'21 (arXiv 2104.04473) Table 1: GPT 1.7B-1T on 32-3072
     A100 80 GB (Selene: DGX A100, 8 HDR InfiniBand ports a node), sequence 2048, vocabulary
     51,200, their t/p/d and global batch, full activation recomputation, fp16. The published
     teraFLOP/s per GPU count the recomputed forward (their formula, 96 B s l h^2 (1 + s/6h +
     V/16lh)); the predicted figure is converted to the same count. The software of that date
     (Megatron-LM aed2f75, April 2021) is planned as it ran: attention as baddbmm, a fused
     softmax and dropout over the stored s x s scores (``attention="materialized"``), and the
     data-parallel all-reduce after the backward pass (training.py's train_step), not overlapped
     (``overlap_dp=False``); 1F1B with micro-batches of one sequence (the interleaved schedule is
     not modelled). The table is as printed in the paper; each row's per-GPU figure times its
     GPUs gives its aggregate petaFLOP/s column.

   The planner models the reference GPT, so Llama 3 8B is entered as a GPT of its depth, width,
   heads, sequence and vocabulary; MFU is normalised by each model's own FLOPs.

    python bench/plan.py [--steps 20] [--repeat 2] [--skip-check] [--fit]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from allhands.config import Config, apply_override  # noqa: E402
from allhands.data import prepare  # noqa: E402
from allhands.data.shards import embedded_text  # noqa: E402
from allhands.flops import PEAK_FLOPS, gpt_flops_per_token  # noqa: E402
from allhands.plan import PRESETS, Layout, estimate, parse_cluster, plan  # noqa: E402
from allhands.plan.calibrate import calibrate, recalibrated  # noqa: E402
from allhands.plan.check import check  # noqa: E402
from conftest import TINY  # noqa: E402

LLAMA3 = ["model.seq_len=8192", "model.vocab_size=128256", "model.bias=false",
          "model.tie_embeddings=false", "run.precision=bf16"]
# torchtitan's FLOPs per token of Llama 3(.1): 6 x the non-embedding parameters (8.03e9 / 70.55e9
# less the 128256 x C embedding) + 12 x layers x heads x 128 head dim x 8192 tokens.
LLAMA3_FLOPS = {"8b": 6 * (8.03e9 - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192,
                "70b": 6 * (70.55e9 - 128256 * 8192) + 12 * 80 * 64 * 128 * 8192}
LLAMA3_CFG = {"8b": ["model.n_layer=32", "model.n_head=32", "model.n_embd=4096", *LLAMA3],
              "70b": ["model.n_layer=80", "model.n_head=64", "model.n_embd=8192", *LLAMA3]}
# torchtitan's H100s (Grand Teton): 96 GB HBM2e at 2.4 TB/s, 400 Gb/s RDMA a GPU, 500 W limit
TITAN_H100 = "h100:{},hbm_gbs=2400,mem_gb=96"

# (name, source, cluster spec, model, GPUs, tp, local batch, ac, compile, published tokens/s per GPU)
PUBLISHED = [
    ("Llama 3.1 8B FSDP, 8 H100", "torchtitan llama3_h100_202412 Table 1", TITAN_H100.format(1), "8b", 8, 1, 2, "selective", False, 5762),
    ("  + torch.compile", "torchtitan llama3_h100_202412 Table 1", TITAN_H100.format(1), "8b", 8, 1, 2, "selective", True, 6667),
    ("Llama 3.1 8B FSDP, 128 H100", "torchtitan llama3_h100_202412 Table 3", TITAN_H100.format(16), "8b", 128, 1, 2, "selective", False, 5605),
    ("  + torch.compile", "torchtitan llama3_h100_202412 Table 3", TITAN_H100.format(16), "8b", 128, 1, 2, "selective", True, 6514),
    ("Llama 3 8B FSDP8 TP8, 64 H100", "torchtitan asyncTP_llama3_h100_2025-06 (vanilla TP, bf16)", TITAN_H100.format(8), "8b", 64, 8, 12, "selective", True, 4378),
    ("Llama 3 70B FSDP32 TP8, 256 H100", "torchtitan asyncTP_llama3_h100_2025-06 (vanilla TP, bf16)", TITAN_H100.format(32), "70b", 256, 8, 16, "block", True, 597.3),
    ("Llama 3 8B FSDP2, 64 A100 (sel. layer)", "torchtitan docs/performance.md 2024", "a100:8", "8b", 64, 1, 1, "selective", False, 2904),
    ("Llama 3 8B FSDP2, 64 A100 (sel. op)", "torchtitan docs/performance.md 2024", "a100:8", "8b", 64, 1, 1, "selective", False, 2973),
]
# plan --check's model: TINY's layouts (pp=2 over 4 blocks, tp=2 over 4 heads, 16 sequences in 4
# microbatches) with steps long enough to time
CHECKED = [*TINY, "model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.seq_len=64",
           "run.global_batch=16"]
NVL_PEAK = 835e12  # H100 NVL dense bf16, the lower end of the peak torchtitan's footnote gives

# llm-foundry scripts/train/benchmarking/README.md (mosaicml/llm-foundry 061f2c7), "H100 80GB
# BF16": MPT models (the reference GPT: learned positions, biases, LayerNorm, tied embeddings,
# vocabulary 50,368; each row's NumParams equals the planner's count), Composer FSDP FULL_SHARD,
# amp_bf16, flash attention, 8 GPUs a node. (model, sequence, GPUs, micro batch, accumulation,
# activation checkpointing, published tokens/s per GPU, published NumParams)
MPT = {"70b": (80, 8192, 64), "30b": (48, 7168, 64), "13b": (40, 5120, 40), "7b": (32, 4096, 32),
       "3b": (32, 2560, 20), "1b": (24, 2048, 16), "760m": (24, 1536, 12), "350m": (24, 1024, 16),
       "125m": (12, 768, 12)}  # layers, width, heads (scripts/train/yamls/pretrain/mpt-*.yaml)
MPT_H100 = [("70b", 2048, 64, 8, 4, True, 1039, 64862437376), ("70b", 2048, 32, 2, 16, True, 882, 64862437376),
            ("30b", 8192, 8, 1, 21, True, 1384, 30019254272), ("30b", 4096, 8, 1, 21, True, 1802, 29989894144),
            ("30b", 2048, 32, 14, 3, True, 2308, 29975214080),
            ("30b", 2048, 16, 10, 3, True, 2263, 29975214080),
            ("30b", 2048, 8, 3, 21, True, 2002, 29975214080), ("30b", 1024, 8, 6, 21, True, 2084, 29967874048),
            ("13b", 32768, 8, 1, 3, True, 1976, 13011240960), ("13b", 16384, 8, 3, 3, True, 2985, 12927354880),
            ("13b", 4096, 8, 10, 3, True, 4717, 12864440320),
            ("13b", 2048, 64, 2, 1, False, 4800, 12853954560),
            ("13b", 2048, 32, 2, 1, False, 4811, 12853954560),
            ("13b", 2048, 16, 2, 1, False, 4767, 12853954560),
            ("13b", 2048, 8, 2, 1, False, 4792, 12853954560), ("13b", 1024, 8, 40, 3, True, 5502, 12848711680),
            ("7b", 65536, 8, 1, 2, True, 1956, 6918905856), ("7b", 32768, 8, 2, 2, True, 3318, 6784688128),
            ("7b", 8192, 8, 8, 2, True, 6935, 6684024832), ("7b", 4096, 8, 16, 2, True, 8611, 6667247616),
            ("7b", 2048, 8, 6, 1, False, 10643, 6658859008), ("7b", 1024, 8, 64, 2, True, 10203, 6654664704),
            ("3b", 65536, 8, 1, 2, True, 3262, 2814366720), ("3b", 32768, 8, 3, 6, True, 5873, 2730480640),
            ("3b", 16384, 8, 1, 6, False, 11152, 2688537600), ("3b", 8192, 8, 3, 6, False, 16578, 2667566080),
            ("3b", 4096, 8, 5, 6, False, 20964, 2657080320), ("3b", 2048, 64, 6, 3, False, 22525, 2651837440),
            ("3b", 2048, 32, 6, 3, False, 23021, 2651837440),
            ("3b", 2048, 16, 10, 3, False, 24142, 2651837440),
            ("3b", 1024, 8, 20, 6, False, 27046, 2649216000), ("3b", 512, 8, 40, 6, False, 27965, 2647905280),
            ("1b", 65536, 8, 1, 2, True, 5506, 1445974016), ("1b", 32768, 8, 1, 4, False, 12025, 1378865152),
            ("1b", 16384, 8, 2, 4, False, 19649, 1345310720), ("1b", 8192, 8, 3, 4, False, 29157, 1328533504),
            ("1b", 4096, 8, 7, 4, False, 38535, 1320144896), ("1b", 2048, 64, 20, 1, False, 44402, 1315950592),
            ("1b", 2048, 32, 20, 1, False, 45130, 1315950592),
            ("1b", 2048, 16, 20, 1, False, 46037, 1315950592),
            ("1b", 2048, 8, 14, 1, False, 45455, 1315950592), ("1b", 1024, 8, 18, 4, False, 48910, 1313853440),
            ("1b", 512, 8, 56, 4, False, 52275, 1312804864), ("760m", 32768, 8, 1, 2, False, 16291, 807656448),
            ("760m", 16384, 8, 3, 2, False, 27815, 782490624),
            ("760m", 8192, 8, 6, 2, False, 41825, 769907712),
            ("760m", 4096, 8, 12, 2, False, 55459, 763616256),
            ("760m", 2048, 32, 24, 1, False, 67971, 760470528),
            ("760m", 2048, 16, 24, 1, False, 68551, 760470528),
            ("760m", 2048, 8, 24, 2, False, 63147, 760470528),
            ("760m", 1024, 8, 48, 2, False, 78581, 758897664),
            ("760m", 512, 8, 96, 2, False, 83749, 758111232)]

# The same README's "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" table, the same software:
# every amp_bf16 row (8 GPUs, one node), and the two 70b rows on 32 and 64 GPUs, which ran Composer's
# "PURE" FSDP mixed precision: parameters, gradient reduction and buffers in bf16 (composer's
# get_mixed_precision), planned with parallel.reduce_dtype=bf16. 1600 Gb/s a node is 8 x 25 GB/s.
# per model, all on 8 GPUs: (sequence, micro batch, accumulation, checkpointing, tokens/s per GPU, NumParams)
MPT_A100_8 = {
    "30b": [(8192, 1, 21, True, 574, 30019254272), (4096, 1, 21, True, 814, 29989894144), (2048, 3, 21, True, 916, 29975214080), (1024, 6, 21, True, 946, 29967874048), (512, 12, 21, True, 967, 29964204032)],
    "13b": [(32768, 1, 3, True, 1016, 13011240960), (16384, 3, 3, True, 1431, 12927354880), (8192, 5, 3, True, 1795, 12885411840), (4096, 10, 3, True, 2060, 12864440320), (2048, 2, 3, False, 2262, 12853954560), (1024, 40, 3, True, 2330, 12848711680)],
    "7b": [(65536, 1, 2, True, 1013, 6918905856), (32768, 2, 2, True, 1672, 6784688128), (16384, 4, 2, True, 2453, 6717579264), (8192, 8, 2, True, 3206, 6684024832), (4096, 16, 2, True, 3684, 6667247616), (2048, 6, 2, False, 4641, 6658859008), (1024, 64, 2, True, 4357, 6654664704)],
    "3b": [(65536, 1, 2, True, 1767, 2814366720), (32768, 3, 6, True, 3029, 2730480640), (16384, 1, 6, False, 5529, 2688537600), (8192, 3, 6, False, 7695, 2667566080), (4096, 5, 6, False, 9457, 2657080320), (2048, 10, 2, False, 10811, 2651837440), (1024, 20, 6, False, 11580, 2649216000), (512, 40, 6, False, 12127, 2647905280)],
    "1b": [(65536, 1, 2, True, 3044, 1445974016), (32768, 1, 4, False, 6275, 1378865152), (16384, 2, 4, False, 9956, 1345310720), (8192, 3, 4, False, 13814, 1328533504), (4096, 7, 4, False, 17807, 1320144896), (2048, 14, 4, False, 20513, 1315950592), (1024, 18, 4, False, 22112, 1313853440), (512, 56, 4, False, 23148, 1312804864)],
    "760m": [(65536, 1, 2, True, 4143, 857988096), (32768, 1, 2, False, 8802, 807656448), (16384, 3, 2, False, 14274, 782490624), (8192, 6, 2, False, 20933, 769907712), (4096, 12, 2, False, 27351, 763616256), (2048, 24, 2, False, 32434, 760470528), (1024, 48, 2, False, 29765, 758897664), (512, 96, 2, False, 29446, 758111232)],
    "350m": [(65536, 1, 2, False, 7524, 420997120), (32768, 2, 2, False, 13652, 387442688), (16384, 4, 2, False, 23559, 370665472), (8192, 8, 2, False, 36569, 362276864), (4096, 16, 2, False, 49555, 358082560), (2048, 32, 2, False, 58782, 355985408), (1024, 64, 2, False, 64813, 354936832), (512, 128, 2, False, 69330, 354412544)],
    "125m": [(65536, 1, 2, False, 20368, 174070272), (32768, 2, 2, False, 36407, 148904448), (16384, 4, 2, False, 60040, 136321536), (8192, 8, 2, False, 90392, 130030080), (4096, 16, 2, False, 118396, 126884352), (2048, 40, 2, False, 142830, 125311488), (2048, 32, 2, False, 141737, 125311488), (1024, 64, 2, False, 156468, 124525056), (512, 128, 2, False, 165681, 124131840)]}
MPT_A100 = [(model, *row[:1], 8, *row[1:]) for model, rows in MPT_A100_8.items() for row in rows]
MPT_A100_PURE = [("70b", 2048, 64, 8, 4, True, 410, 64862437376),
                 ("70b", 2048, 32, 2, 16, True, 373, 64862437376)]

# Narayanan et al. 2021, Table 1: (parameters B, heads, hidden, layers, t, p, GPUs, global batch,
# published teraFLOP/s per GPU, recomputation included)
MEGATRON = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
            (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
            (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
            (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
            (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def _config(*items: str) -> Config:
    cfg = Config()
    for item in items:
        apply_override(cfg, item)
    return cfg


A100_ROCE = "a100:{},inter_gbs=25"  # llm-foundry's A100 nodes: 1600 Gb/s RoCE a node, 8 x 25 GB/s


def mpt_config(model: str, seq: int, gpus: int = 8, micro: int = 1, accum: int = 1,
               pure: bool = False) -> Config:
    layers, width, heads = MPT[model]
    return _config(f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={width}",
                   f"model.seq_len={seq}", "model.vocab_size=50368", "model.bias=true",
                   "model.tie_embeddings=true", "model.dropout=0.0", "run.precision=bf16",
                   f"run.global_batch={micro * accum * gpus}", f"run.micro_batches={accum}",
                   f"parallel.reduce_dtype={'bf16' if pure else 'fp32'}")


def _mpt(row: tuple, gpu: str, spec: str, pure: bool, table: str) -> "Row":
    """Plan one llm-foundry row as it ran: FSDP FULL_SHARD, no dropout (MPT's defaults: attn_pdrop,
    resid_pdrop and emb_pdrop 0), flash-attn's fused cross-entropy (``loss_fn`` defaults to
    ``fused_crossentropy`` in llmfoundry/models/mpt/modeling_mpt.py at 061f2c7)."""
    model, seq, gpus, micro, accum, ckpt, pub_tps, _ = row
    layers, width, _ = MPT[model]
    layout = Layout(1, gpus, 1, 1, 3, 1, "block" if ckpt else "none", False)
    cfg = mpt_config(model, seq, gpus, micro, accum, pure)
    base = parse_cluster(spec.format(gpus // 8))
    peak = PEAK_FLOPS[gpu]["bf16"]
    pub = pub_tps * gpt_flops_per_token(n_layer=layers, n_embd=width, seq_len=seq, vocab_size=50368) / peak
    label = f"MPT {model} T={seq} mb{micro}x{accum}{' ac' if ckpt else ''}, {gpus} {gpu}"

    def predict(terms: dict) -> tuple[float, str]:
        est = estimate(cfg, layout, dataclasses.replace(base, **terms), True, loss="fused")
        return est.mfu, " [planner: does not fit]" if est.reason else ""
    return Row(f"llm-foundry {table}", gpu, label, pub, predict, f"llm-foundry benchmarking {table}")


def this_machine(steps: int, repeat: int) -> None:
    tokens = Path(ROOT / ".bench-plan-tokens")
    if not (tokens / "meta.json").exists():
        prepare(embedded_text().split("\n\n")[:300], tokens, val_fraction=0.1)
    cfg = _config(*CHECKED, f"data.path={tokens}")
    calibrate(2)
    cluster = parse_cluster("local", 2)
    estimates = plan(cfg, cluster, compile_options=(False,), ac_options=("none",))
    again = recalibrated(cfg, 2)
    loads: dict[str, list[float]] = {}

    def refresh(est):  # the machine measured again right before each layout; its load recorded
        new = again(est)
        loads.setdefault(est.layout.name(), []).append(os.getloadavg()[0])
        return new

    runs = [check(cfg, estimates, cluster, steps=steps, refresh=refresh) for _ in range(repeat)]
    head = (f"{'layout':<22} {'peak MiB pred/meas':>19} {'err':>6} {'ok':>3}  {'step ms pred (runs)':>19} "
            f"{'best (runs)':>13} {'ratios':>11} {'ok':>3} {'median (runs)':>13} {'load':>9}")
    print(head + "\n" + "-" * len(head))
    hits = [0, 0]
    for rows in zip(*runs):
        e = rows[0].estimate
        peak = max(r.peak for r in rows)
        mem_err = e.memory["total"] / peak - 1
        ratios = [r.estimate.time["step"] / r.step_time for r in rows]
        ok = (abs(mem_err) <= 0.10, all(abs(x - 1) <= 0.25 for x in ratios))
        hits = [hits[0] + ok[0], hits[1] + ok[1]]
        pred = "/".join(f"{1e3 * r.estimate.time['step']:.1f}" for r in rows)
        best = "/".join(f"{1e3 * r.step_time:.1f}" for r in rows)
        median = "/".join(f"{1e3 * r.step_median:.1f}" for r in rows)
        load = "/".join(f"{x:.0f}" for x in loads[e.layout.name()])
        print(f"{e.layout.name():<22} {e.memory['total'] / 2**20:>9.1f}/{peak / 2**20:<9.1f} "
              f"{100 * mem_err:>+5.1f}% {'yes' if ok[0] else 'NO':>3}  {pred:>19} "
              f"{best:>13} {'/'.join(f'{x:.2f}' for x in ratios):>11} {'yes' if ok[1] else 'NO':>3} "
              f"{median:>13} {load:>9}")
    n = len(runs[0])
    print(f"memory within 10%: {hits[0]}/{n} layouts; step time within 25% in every run: {hits[1]}/{n} "
          f"(predicted from a calibration measured right before each layout; measured: the fastest "
          f"step after the first 2, as the calibration times its probes; load: 1-minute load average)")


@dataclasses.dataclass
class Row:
    """One published run: its table, GPU generation, label, published MFU and the planner's
    prediction for a set of kernel terms (``{}``: the cluster preset's own)."""
    table: str
    gpu: str
    label: str
    pub: float
    predict: Callable[[dict], tuple[float, str]]
    source: str
    fit: bool = False  # in the named half the terms are fitted on (FIT_RULE)


def _llama_row(name, source, spec, model, gpus, tp, local, ac, comp, pub_tps) -> Row:
    cfg = _config(*LLAMA3_CFG[model], f"run.global_batch={local * gpus // tp}")
    gpu = "H100" if spec.startswith("h100") else "A100"
    peak = PEAK_FLOPS[gpu]["bf16"]
    layout = Layout(1, gpus // tp, tp, 1, 3, 1, ac, comp)
    base = parse_cluster(spec)

    def predict(terms: dict) -> tuple[float, str]:
        c = dataclasses.replace(base, **terms)
        if gpu == "A100":
            return estimate(cfg, layout, c, True).mfu, ""
        # the part's peak lies between the SXM's 989 and the NVL's 835 (the source's footnote): the
        # geometric middle, the MFU still against 989; the two ends are printed beside it
        ends = [estimate(cfg, layout, dataclasses.replace(c, peak_bf16=x), True).mfu * x / peak
                for x in (NVL_PEAK, peak)]
        return (ends[0] * ends[1]) ** 0.5, f" (at 835-989: {100 * ends[0]:.1f}-{100 * ends[1]:.1f}%)"
    return Row(f"torchtitan {gpu}", gpu, name, pub_tps * LLAMA3_FLOPS[model] / peak, predict, source)


def _megatron_row(params, heads, hidden, layers, t, p, gpus, batch, tflops) -> Row:
    d = gpus // (t * p)
    cfg = _config(f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={hidden}",
                  "model.seq_len=2048", "model.vocab_size=51200", "model.bias=true",
                  "model.tie_embeddings=true", "run.precision=bf16", f"run.global_batch={batch}",
                  # no sequence parallelism in 2021 (Korthikanti et al. 2022 added it): every
                  # tensor-parallel rank holds its norms' whole gradients
                  "parallel.tp_sequence_parallel=false",
                  f"run.micro_batches={batch // d if p == 1 else 1}")  # sequences of one
    layout = Layout(d, 1, t, p, 0, batch // d if p > 1 else 1, "block", False)
    base = parse_cluster(f"a100:{gpus // 8}")
    model = gpt_flops_per_token(n_layer=layers, n_embd=hidden, seq_len=2048, vocab_size=51200)
    counted = model + 24 * layers * hidden ** 2 + 4 * layers * hidden * 2048  # + the recompute
    pub = tflops * 1e12 * model / counted / PEAK_FLOPS["A100"]["bf16"]

    def predict(terms: dict) -> tuple[float, str]:
        est = estimate(cfg, layout, dataclasses.replace(base, **terms), True, attention="materialized",
                       overlap_dp=False)
        return est.mfu, (f" ({tflops} TFLOP/s, pred {est.mfu * counted / model * 312:.0f})"
                         + (" [planner: does not fit]" if est.reason else ""))
    return Row("Megatron-LM A100", "A100", f"GPT {params}B t{t} p{p} d{d}, {gpus} A100", pub, predict,
               "Narayanan et al. 2021 Table 1")


# The half of each table the kernel terms are fitted on: rows 0, 2, 4, ... in the order each table
# is entered above; rows 1, 3, 5, ... are held out.
FIT_RULE = "every other row of each table, from its first (rows 0, 2, 4, ...); the rest held out"


def rows() -> list[Row]:
    """Every published run, each table's even rows marked as the fitting half."""
    out = [_llama_row(*r) for r in PUBLISHED]
    for gpu, spec, rows_, pure in (("H100", "h100:{}", MPT_H100, False), ("A100", A100_ROCE, MPT_A100, False),
                                   ("A100", A100_ROCE, MPT_A100_PURE, True)):
        table = "H100 80GB BF16" if gpu == "H100" else "A100 80GB RoCE"
        out += [_mpt(row, gpu, spec, pure, table) for row in rows_]
    out += [_megatron_row(*r) for r in MEGATRON]
    seen: dict[str, int] = {}
    for r in out:
        r.fit = seen.get(r.table, 0) % 2 == 0
        seen[r.table] = seen.get(r.table, 0) + 1
    return out


FIT_BOUNDS = {"gemm_eff": (0.40, 0.95), "attn_eff": (0.15, 0.95), "ew_eff": (0.20, 1.00),
              "gemm_k0": (0.0, 1000.0), "overlap": (0.0, 1.0)}


# fixed starting points, so that --fit gives the same terms whatever the presets hold
FIT_STARTS = [{"gemm_eff": 0.75, "attn_eff": 0.5, "ew_eff": 0.8, "gemm_k0": 200.0, "overlap": 0.5},
              {"gemm_eff": 0.8, "attn_eff": 0.3, "ew_eff": 0.7, "gemm_k0": 500.0, "overlap": 0.0}]


def fit(rows_: list[Row], gpu: str, starts: list[dict], evals: int = 300) -> dict:
    """The kernel terms of one GPU generation that minimise the squared log ratio of predicted
    to published MFU over its fitting rows: Nelder-Mead inside FIT_BOUNDS from each start."""
    mine = [r for r in rows_ if r.gpu == gpu and r.fit]
    keys = list(FIT_BOUNDS)

    def terms_of(x):
        return {k: lo + min(1.0, max(0.0, xi)) * (hi - lo) for k, xi, (lo, hi) in zip(keys, x, FIT_BOUNDS.values())}

    def loss(x):
        return sum(math.log(r.predict(terms_of(x))[0] / r.pub) ** 2 for r in mine)
    best = None
    for start in starts:
        x0 = [(start[k] - lo) / (hi - lo) for k, (lo, hi) in FIT_BOUNDS.items()]
        simplex = [x0] + [[xi + (0.15 if i == j else 0.0) for j, xi in enumerate(x0)] for i in range(len(x0))]
        scored = sorted((loss(x), x) for x in simplex)
        for _ in range(evals):
            scored.sort()
            centre = [sum(x[i] for _, x in scored[:-1]) / (len(scored) - 1) for i in range(len(keys))]
            worst = scored[-1][1]
            refl = [c + (c - w) for c, w in zip(centre, worst)]
            fr = loss(refl)
            if fr < scored[0][0]:
                exp = [c + 2 * (c - w) for c, w in zip(centre, worst)]
                fe = loss(exp)
                scored[-1] = (fe, exp) if fe < fr else (fr, refl)
            elif fr < scored[-2][0]:
                scored[-1] = (fr, refl)
            else:
                con = [c + 0.5 * (w - c) for c, w in zip(centre, worst)]
                fc = loss(con)
                if fc < scored[-1][0]:
                    scored[-1] = (fc, con)
                else:  # shrink towards the best
                    b0 = scored[0][1]
                    scored = [scored[0]] + [(loss(y), y) for y in
                                            ([b + 0.5 * (xi - b) for b, xi in zip(b0, x)] for _, x in scored[1:])]
        top = min(scored)
        if best is None or top[0] < best[0]:
            best = top
    return {k: round(v, 0 if k == "gemm_k0" else 2) for k, v in terms_of(best[1]).items()}


def published(terms: dict | None = None) -> list[tuple[Row, float]]:
    """Print predicted against published MFU, the fitting half and the held-out half apart, and
    the spread of each generation's held-out ratios; return (row, ratio) for every row."""
    out = [(r, *r.predict(terms.get(r.gpu, {}) if terms else {})) for r in rows()]
    head = f"{'run':<40} {'MFU pred':>9} {'pub':>6} {'ratio':>6}  source"
    result = []
    for half, title in ((True, "fitting half"), (False, "held out")):
        print(f"{title} ({FIT_RULE}):\n{head}\n" + "-" * len(head))
        for r, mfu, note in out:
            if r.fit == half:
                print(f"{r.label:<40} {100 * mfu:>8.1f}% {100 * r.pub:>5.1f}% {mfu / r.pub:>6.2f}  {r.source}{note}")
                result.append((r, mfu / r.pub))
        print()
    print(f"{'table':<28} {'fit: rows, ratio range':>26} {'held out: rows, ratio range':>30} {'within 20%':>11}")
    for table in dict.fromkeys(r.table for r, _, _ in out):
        parts = []
        for half in (True, False):
            rs = [x for r, x in result if r.table == table and r.fit == half]
            parts.append(f"{len(rs)}, {min(rs):.2f}-{max(rs):.2f}" if rs else "-")
        held = [x for r, x in result if r.table == table and not r.fit]
        ok = sum(abs(x - 1) <= 0.2 for x in held)
        print(f"{table:<28} {parts[0]:>26} {parts[1]:>30} {f'{ok}/{len(held)}':>11}")
    for gpu in ("A100", "H100"):
        held = [x for r, x in result if r.gpu == gpu and not r.fit]
        preset = PRESETS[gpu.lower()].interval
        print(f"{gpu} held out: measured / predicted {1 / max(held):.2f}-{1 / min(held):.2f} over {len(held)} rows "
              f"(the {gpu.lower()} preset's interval, which plan prints beside each figure: "
              f"{preset[0]:.2f}-{preset[1]:.2f})")
    print("MFU = model FLOPs (no recomputation) / step time / datasheet peak (H100 SXM 989, A100 312 "
          "bf16 TFLOP/s); target: predicted within 20% of published")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-check", action="store_true", help="only the published comparison")
    ap.add_argument("--fit", action="store_true", help="fit the kernel terms of each GPU generation on "
                    "the fitting half again, print them and the comparison under them")
    args = ap.parse_args()
    if not args.skip_check:
        this_machine(args.steps, args.repeat)
        print()
    terms = None
    if args.fit:
        all_rows = rows()
        terms = {}
        for gpu in ("A100", "H100"):
            terms[gpu] = fit(all_rows, gpu, FIT_STARTS)
            print(f"{gpu} fitted: " + ", ".join(f"{k}={v:g}" for k, v in terms[gpu].items()))
    published(terms)


if __name__ == "__main__":
    main()
