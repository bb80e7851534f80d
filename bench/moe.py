"""Expert parallelism on 2 CPU workers: all_to_all volume against the formula, and step time.

A small MoE decoder (llama family, dim 128, 4 layers all MoE, 8 experts, top-2, expert width
128, seq 64, global batch 16, FSDP ZeRO-3 over the 2 ranks, fp32) trains ``--steps`` steps at
``parallel.ep=2`` and at ``ep=1``, alternating ``--rounds`` times; from metrics.jsonl:

- all_to_all payload a rank sends per step (forward dispatch + combine, counted by the
  dispatcher) over the formula ``2 directions x layers x tokens x top_k x hidden x 4 bytes x
  (ep-1)/ep`` (tokens: this rank's per step), the volume of uniform routing; target <= 1.05;
- step time (median of steps after the first two) at ep=2 over ep=1, and the share of the ep=2
  step spent inside the exchanges (forward and backward; the count exchange excluded);
- beside them, what ``allhands plan --cluster local`` predicts for both layouts (its step times,
  their ratio and the all_to_all share), so the planner's MoE pricing is checked by a real run.

    python bench/moe.py [--rounds 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DIM, LAYERS, TOP_K, SEQ, BATCH, EXPERTS = 128, 4, 2, 64, 16, 8


def config(tmp: Path, name: str, ep: int, steps: int):
    from allhands.config import Config, apply_override

    cfg = Config()
    for item in ("model.family=llama", f"model.n_embd={DIM}", f"model.n_layer={LAYERS}",
                 "model.n_head=4", "model.n_kv_head=2", f"model.seq_len={SEQ}", "model.ffn_hidden=256",
                 f"moe.n_experts={EXPERTS}", f"moe.top_k={TOP_K}", "moe.ffn_hidden=128",
                 "parallel.dp_shard=2", "parallel.zero=3", f"parallel.ep={ep}",
                 f"run.steps={steps}", f"run.global_batch={BATCH}", "run.eval_interval=0",
                 "run.precision=fp32", "checkpoint.interval=0", "checkpoint.at_end=false",
                 "log.progress=false", "log.tensorboard=false", f"run.dir={tmp / name}"):
        apply_override(cfg, item)
    return cfg


def run(tmp: Path, name: str, ep: int, steps: int) -> list[dict]:
    from allhands.launch.launcher import LaunchSpec, train_job

    train_job(config(tmp, name, ep, steps), LaunchSpec(nproc=2))
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step_time" in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    from allhands.plan import Layout, estimate, parse_cluster
    from allhands.plan.calibrate import calibrate
    from allhands.plan.decoder import Decoder
    from allhands.plan.experts import a2a_bytes

    tokens = BATCH // 2 * SEQ  # per rank per step
    cfg = config(Path("."), "plan", 2, a.steps)
    formula = 2 * LAYERS * a2a_bytes(Decoder.of(cfg.model, cfg.moe), tokens, 2, 4)  # the planner's
    assert formula == 2 * LAYERS * tokens * TOP_K * DIM * 4 * (2 - 1) / 2
    calibrate(2)
    local = parse_cluster("local", 2)
    planned = {ep: estimate(cfg, Layout(1, 2, 1, 1, 3, ep=ep), local, False).time for ep in (1, 2)}
    t1, t2, share, ratio = [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for ep in (2, 1):
                recs = run(Path(d), f"r{r}-ep{ep}", ep, a.steps)[2:]
                step = statistics.median(x["step_time"] for x in recs)
                (t2 if ep == 2 else t1).append(step)
                if ep == 2:
                    ratio.append(statistics.mean(x["moe_a2a_bytes"] for x in recs) / formula)
                    share.append(statistics.median(x["moe_a2a_time"] / x["step_time"] for x in recs))
    print(f"all_to_all bytes/rank/step / formula ({formula / 1e6:.2f} MB): "
          f"{statistics.mean(ratio):.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratio)})")
    print(f"step time ep=1 {statistics.median(t1) * 1e3:.0f} ms, ep=2 {statistics.median(t2) * 1e3:.0f} ms, "
          f"ep2/ep1 {statistics.median(t2) / statistics.median(t1):.2f}")
    print(f"share of the ep=2 step in dispatch + combine: {statistics.median(share):.3f}")
    p1, p2 = planned[1]["step"], planned[2]["step"]
    print(f"planned (allhands plan --cluster local): ep=1 {p1 * 1e3:.0f} ms, ep=2 {p2 * 1e3:.0f} ms, "
          f"ep2/ep1 {p2 / p1:.2f}, all_to_all share {planned[2]['all_to_all'] / p2:.3f}; "
          f"measured/planned step ep=1 {statistics.median(t1) / p1:.2f}, ep=2 {statistics.median(t2) / p2:.2f}")


if __name__ == "__main__":
    main()
