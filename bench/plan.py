"""How close ``allhands plan`` comes: on this machine, and against published runs.

1. This machine. ``plan --check`` on the tiny reference GPT (tests/conftest.py's TINY) with 2
   workers: every layout that fits is trained ``--steps`` steps through the launcher, ``--repeat``
   times, and its predicted peak memory and step time (``--cluster local``: composed from the
   machine's cached calibration, plan/calibrate.py, never from a measured step of the layout) are
   put beside the measured ones. Targets: peak memory within 10%, step time within 25% in every
   repeat. Step times are the fastest step after the first two, the statistic the calibration
   uses for its probes (other processes only add time); the median is shown beside it.

2. Published runs. Predicted MFU and tokens/s per GPU for configurations whose throughput was
   published, from the cluster presets (datasheet peaks, flops.py; link figures, cluster.py):

   - torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md`` (also its docs/performance.md
     of that date): Llama 3.1 8B, FSDP, local batch 2, sequence 8192, selective AC, bf16, on 8
     and on 128 H100 (Grand Teton: 96 GB HBM2e at 2.4 TB/s, 500 W power limit): 5,762 / 6,667
     tokens/s per GPU on 8 (eager / torch.compile), 5,605 / 6,514 on 128; MFU 33% / 39%.
   - torchtitan, docs/performance.md (2024, before the H100 runs): Llama 3 8B, FSDP2 on 64 A100
     80 GB, local batch 1, selective layer / op AC: 2,904 / 2,973 tokens/s per GPU, MFU 56.8% /
     58.2%.

   The planner models the reference GPT, so Llama 3 8B is entered as a GPT of its depth, width,
   heads, sequence and vocabulary; MFU is normalised by each model's own FLOPs, and the
   predicted tokens/s is the predicted MFU times the peak over Llama's FLOPs per token
   (torchtitan's count: 6 x non-embedding parameters + 12 L H Q T).

    python bench/plan.py [--steps 10] [--repeat 2] [--skip-check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from allhands.config import Config, apply_override  # noqa: E402
from allhands.data import prepare  # noqa: E402
from allhands.data.shards import embedded_text  # noqa: E402
from allhands.flops import PEAK_FLOPS  # noqa: E402
from allhands.plan import Layout, estimate, parse_cluster, plan  # noqa: E402
from allhands.plan.calibrate import calibrate  # noqa: E402
from allhands.plan.check import check  # noqa: E402
from conftest import TINY  # noqa: E402

LLAMA3_8B = ["model.n_layer=32", "model.n_head=32", "model.n_embd=4096", "model.seq_len=8192",
             "model.vocab_size=128256", "model.bias=false", "model.tie_embeddings=false",
             "run.precision=bf16"]
# torchtitan's FLOPs per token of Llama 3(.1) 8B: 6 x 7.50e9 non-embedding parameters (8.03e9
# less the 128256 x 4096 embedding) + 12 x 32 layers x 32 heads x 128 head dim x 8192 tokens.
LLAMA3_8B_FLOPS = 6 * (8.03e9 - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192

# (name, source, cluster spec, GPUs, local batch, ac, compile, published tokens/s per GPU)
PUBLISHED = [
    ("Llama 3.1 8B FSDP, 8 H100", "torchtitan llama3_h100_202412 Table 1", "h100:1", 8, 2, "selective", False, 5762),
    ("  + torch.compile", "torchtitan llama3_h100_202412 Table 1", "h100:1", 8, 2, "selective", True, 6667),
    ("Llama 3.1 8B FSDP, 128 H100", "torchtitan llama3_h100_202412 Table 3", "h100:16", 128, 2, "selective", False, 5605),
    ("  + torch.compile", "torchtitan llama3_h100_202412 Table 3", "h100:16", 128, 2, "selective", True, 6514),
    ("Llama 3 8B FSDP2, 64 A100 (sel. layer)", "torchtitan docs/performance.md 2024", "a100:8", 64, 1, "selective", False, 2904),
    ("Llama 3 8B FSDP2, 64 A100 (sel. op)", "torchtitan docs/performance.md 2024", "a100:8", 64, 1, "selective", False, 2973),
]


def _config(*items: str) -> Config:
    cfg = Config()
    for item in items:
        apply_override(cfg, item)
    return cfg


def this_machine(steps: int, repeat: int) -> None:
    tokens = Path(ROOT / ".bench-plan-tokens")
    if not (tokens / "meta.json").exists():
        prepare(embedded_text().split("\n\n")[:300], tokens, val_fraction=0.1)
    cfg = _config(*TINY, f"data.path={tokens}")
    cal = calibrate(2)
    print(f"calibration (cached; plan/calibrate.py): gloo all-reduce {1e6 * cal['allreduce'][0]:.0f} us "
          f"+ {1e9 * cal['allreduce'][1]:.2f} ns/B, DDP {1e3 * cal['ddp_step']:.1f} ms, FSDP2 unit "
          f"{1e3 * cal['fsdp_unit_zero2']:.1f}/{1e3 * cal['fsdp_unit_zero3']:.1f} ms, TP module "
          f"{1e3 * cal['tp_module']:.1f} ms, 1F1B microbatch {1e3 * cal['pp_microbatch']:.1f} ms, "
          f"contention x{cal['contention']:.2f}, worker runtime {cal['runtime'] / 2**20:.0f} MiB")
    cluster = parse_cluster("local", 2)
    estimates = plan(cfg, cluster, compile_options=(False,), ac_options=("none",))
    runs = [check(cfg, estimates, cluster, steps=steps) for _ in range(repeat)]
    head = (f"{'layout':<22} {'peak MiB pred/meas':>19} {'err':>6} {'ok':>3}  {'step ms pred':>12} "
            f"{'best (runs)':>13} {'ratios':>11} {'ok':>3} {'median (runs)':>13}")
    print(head + "\n" + "-" * len(head))
    hits = [0, 0]
    for rows in zip(*runs):
        e = rows[0].estimate
        peak = max(r.peak for r in rows)
        mem_err = e.memory["total"] / peak - 1
        ratios = [e.time["step"] / r.step_time for r in rows]
        ok = (abs(mem_err) <= 0.10, all(abs(x - 1) <= 0.25 for x in ratios))
        hits = [hits[0] + ok[0], hits[1] + ok[1]]
        best = "/".join(f"{1e3 * r.step_time:.1f}" for r in rows)
        median = "/".join(f"{1e3 * r.step_median:.1f}" for r in rows)
        print(f"{e.layout.name():<22} {e.memory['total'] / 2**20:>9.1f}/{peak / 2**20:<9.1f} "
              f"{100 * mem_err:>+5.1f}% {'yes' if ok[0] else 'NO':>3}  {1e3 * e.time['step']:>12.1f} "
              f"{best:>13} {'/'.join(f'{x:.2f}' for x in ratios):>11} {'yes' if ok[1] else 'NO':>3} {median:>13}")
    n = len(runs[0])
    print(f"memory within 10%: {hits[0]}/{n} layouts; step time within 25% in every run: {hits[1]}/{n} "
          f"(measured: the fastest step after the first 2, as the calibration times its probes)")


def published() -> None:
    head = (f"{'run':<40} {'MFU pred':>8} {'pub':>6} {'tok/s/GPU pred':>14} {'pub':>6} {'ratio':>6}  source")
    print(head + "\n" + "-" * len(head))
    for name, source, spec, gpus, local, ac, comp, pub_tps in PUBLISHED:
        cluster = parse_cluster(spec)
        cfg = _config(*LLAMA3_8B, f"run.global_batch={local * gpus}")
        est = estimate(cfg, Layout(1, gpus, 1, 1, 3, 1, ac, comp), cluster, True)
        peak = PEAK_FLOPS["H100" if spec.startswith("h100") else "A100"]["bf16"]
        pred_tps = est.mfu * peak / LLAMA3_8B_FLOPS
        pub_mfu = pub_tps * LLAMA3_8B_FLOPS / peak
        print(f"{name:<40} {100 * est.mfu:>7.1f}% {100 * pub_mfu:>5.1f}% {pred_tps:>14,.0f} {pub_tps:>6,} "
              f"{pred_tps / pub_tps:>6.2f}  {source}")
    print("MFU = tokens/s x FLOPs per token / datasheet peak (H100 SXM 989, A100 312 bf16 TFLOP/s); "
          "target: predicted within 25% of published")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-check", action="store_true", help="only the published comparison")
    args = ap.parse_args()
    if not args.skip_check:
        this_machine(args.steps, args.repeat)
        print()
    published()


if __name__ == "__main__":
    main()
