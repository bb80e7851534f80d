#!/usr/bin/env bash
# One or more GPUs. First the reference GPT at ~1.2B parameters (24 blocks x 2048 wide: 12 L C^2 = 1.21e9),
# bf16, every block compiled (run.compile), on the embedded corpus (nothing is downloaded), for
# STEPS steps (default 150: a few minutes on an H100/H200), then the same 30 steps eager;
# prints the median MFU and tokens/s of each over its steps after the first 10 (compile warm-up).
#
#   bash bench/gpu_check.sh            # from the repository root, with .venv made by `make setup`
#   STEPS=60 BATCH=8 bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-150}
BATCH=${BATCH:-16}
OUT=${OUT:-$(mktemp -d /tmp/allhands-gpu-check.XXXXXX)}
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('device:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
common=(--nproc 1 --set run.device=cuda --set run.precision=bf16 --set model.n_layer=24
        --set model.n_head=16 --set model.n_embd=2048 --set model.seq_len=2048 --set model.bias=false
        --set run.global_batch=$BATCH --set optim.warmup_steps=10 --set run.eval_interval=0
        --set data.eval_batches=0 --set checkpoint.interval=0 --set checkpoint.at_end=false
        --set log.tensorboard=false --set log.progress=false)
$PY -m allhands.cli train "${common[@]}" --set run.steps=$STEPS --set run.compile=true --set run.dir=$OUT/compiled
$PY -m allhands.cli train "${common[@]}" --set run.steps=30 --set run.compile=false --set run.dir=$OUT/eager
$PY - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = {}
for name in ("compiled", "eager"):
    rows = [json.loads(x) for x in (Path(sys.argv[1]) / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r][10:]
    out[name] = {k: statistics.median(r[k] for r in steps) for k in ("mfu", "tokens_per_s", "step_time")}
    print(f"{name:>8}: MFU {100 * out[name]['mfu']:.1f}%  {out[name]['tokens_per_s']:,.0f} tokens/s  "
          f"step {out[name]['step_time']:.3f} s  (median of {len(steps)} steps)")
print(f"step time compiled / eager: {out['compiled']['step_time'] / out['eager']['step_time']:.2f}")
PY

# Llama 3 8B's shape (4096 wide, 32 heads over 8 key/value heads, SwiGLU 14336, vocabulary 128256,
# seq 8192 as torchtitan's Llama 3.1 8B runs) with LLAMA_LAYERS blocks (default 2, so one GPU
# holds it), bf16, ZeRO-3 over every GPU; then tp=2 inside FSDP when there are 2 or more.
# Printed beside torchtitan's published Llama 3.1 8B on 8 H100 (FSDP, bf16, no Float8):
# 5,762 tokens/s per GPU and 33-39% MFU with and without compile (torchtitan docs/performance.md).
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
LLAMA_LAYERS=${LLAMA_LAYERS:-2}  # not 4: model.n_layer=4 is the default, which the preset fills
LLAMA_STEPS=${LLAMA_STEPS:-40}
llama=(--nproc $NGPU --set run.device=cuda --set run.precision=bf16 --set model.preset=llama3-8b
       --set model.n_layer=$LLAMA_LAYERS --set model.seq_len=8192 --set run.global_batch=$NGPU
       --set parallel.dp_replicate=1 --set parallel.zero=3 --set run.steps=$LLAMA_STEPS
       --set optim.warmup_steps=10 --set run.eval_interval=0 --set data.eval_batches=0
       --set checkpoint.interval=0 --set checkpoint.at_end=false --set log.tensorboard=false
       --set log.progress=false)
$PY -m allhands.cli train "${llama[@]}" --set parallel.dp_shard=-1 --set run.dir=$OUT/llama-fsdp
runs=(llama-fsdp)
if [ "$NGPU" -ge 2 ]; then
  $PY -m allhands.cli train "${llama[@]}" --set parallel.tp=2 --set parallel.dp_shard=-1 \
      --set run.global_batch=$((NGPU / 2)) --set run.dir=$OUT/llama-tp2
  runs+=(llama-tp2)
else
  echo "llama tp=2: skipped (one GPU)"
fi
$PY - "$OUT" "$NGPU" "${runs[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path
out, ngpu = Path(sys.argv[1]), int(sys.argv[2])
for name in sys.argv[3:]:
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r][10:]
    mfu = statistics.median(r["mfu"] for r in steps)
    tps = statistics.median(r["tokens_per_s"] for r in steps) / ngpu
    print(f"{name:>10}: MFU {100 * mfu:.1f}%  {tps:,.0f} tokens/s per GPU  (median of {len(steps)} "
          f"steps; torchtitan Llama 3.1 8B, 8 H100, FSDP: 33-39% MFU, 5,762 tokens/s per GPU)")
PY
