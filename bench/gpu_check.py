"""The first run on a GPU, as one command: every path a GPU user takes first, each one a real
`allhands train` job (run in this process, one after another, like `allhands` itself), then one
table of what each did.

    bash bench/gpu_check.sh                 # on a GPU machine: torch installed, no network needed
    python bench/gpu_check.py --dry         # the same steps on CPU at toy sizes (tests run this)

The steps, on every visible GPU (NCCL, bf16):
  default      the embedded default job (the README's first command), 40 steps
  llama8b      Llama 3 8B's width (4096 wide, 32 heads over 8 key/value heads, SwiGLU 14336,
               vocabulary 128256) with LLAMA_LAYERS blocks (default 4), FSDP (ZeRO-3) over the
               GPUs, selective activation checkpointing, eager; then the same compiled
  packed       a Llama 3.2 1B-width model on document-masked packing (data.packing=mask)
  moe          a Mixtral-shaped mixture of experts with its expert GEMMs (8 experts, top 2)
  resume       6 steps straight against 3 + a resume to 6: the losses must be equal, bit for bit

A step that fails is a row with its exit code and the last line it printed; the script then
goes on with the next and exits 1 at the end. Medians are over the logged steps after the
first WARMUP (compile and allocator warm-up).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # a bare machine: no `pip install` needed

from allhands.cli import main as allhands  # noqa: E402

WARMUP = 5
QUIET = ["--set", "log.tensorboard=false", "--set", "log.progress=false", "--set", "run.eval_interval=0",
         "--set", "data.eval_batches=0"]


def sets(**fields: object) -> list[str]:
    """``--set section.field=value`` for each ``section__field=value``."""
    return [a for k, v in fields.items() for a in ("--set", f"{k.replace('__', '.')}={v}")]


def steps(out: Path, ngpu: int, dry: bool) -> list[tuple[str, list[str]]]:
    """Each step's name and its `allhands` arguments. ``dry``: CPU, one worker, toy shapes and
    the compiled step through aot_eager in place of the GPU ones, every other setting as on
    the GPU."""
    layers = int(os.environ.get("LLAMA_LAYERS", "4"))
    device = sets(run__device="cpu", run__precision="fp32") if dry else \
        sets(run__device="cuda", run__precision="bf16")
    nproc = ["--nproc", "1" if dry else str(ngpu)]
    toy = sets(model__n_layer=2, model__n_embd=64, model__n_head=4, model__n_kv_head=2,
               model__ffn_hidden=128, model__vocab_size=0) if dry else []
    seq = (lambda n: sets(model__seq_len=32)) if dry else (lambda n: sets(model__seq_len=n))
    n = (lambda k: 3) if dry else (lambda k: k)
    fsdp = sets(parallel__dp_replicate=1, parallel__dp_shard=-1, parallel__zero=3, parallel__ac="selective")
    llama8b = ["--set", "model.preset=llama3-8b", *sets(model__n_layer=layers), *toy, *seq(4096),
               *fsdp, *sets(run__global_batch=(2 if dry else ngpu), run__steps=n(25),
                            optim__warmup_steps=5, checkpoint__interval=0, checkpoint__at_end="false")]
    small = [*sets(checkpoint__interval=0, checkpoint__at_end="false", optim__warmup_steps=5)]
    default = sets(run__global_batch=4) if dry else []  # the default shape, a smaller batch on CPU
    return [
        ("default", ["train", *nproc, *device, *default, *sets(run__steps=n(40)), *small]),
        ("llama8b eager", ["train", *nproc, *device, *llama8b, *sets(run__compile="false")]),
        ("llama8b compiled", ["train", *nproc, *device, *llama8b, *sets(run__compile="true"),
                              # dry: the same graphs without C++ code generation (tens of seconds
                              # on a CPU; tests/test_compile.py runs inductor on CPU)
                              *(sets(run__compile_backend="aot_eager") if dry else [])]),
        ("packed", ["train", *nproc, *device, "--set", "model.preset=llama3.2-1b",
                    *sets(model__n_layer=4), *toy, *seq(4096), *fsdp,
                    *sets(data__packing="mask", run__global_batch=(2 if dry else 2 * ngpu),
                          run__steps=n(20)), *small]),
        ("moe", ["train", *nproc, *device, "--set", "model.preset=mixtral-8x7b",
                 *sets(model__n_layer=2), *toy, *seq(2048), *fsdp,
                 *sets(run__global_batch=(2 if dry else 2 * ngpu), run__steps=n(20)), *small]),
        ("resume", []),  # run() does this one's three jobs
    ]


def run(argv: list[str], run_dir: Path) -> tuple[int, str]:
    """One `allhands` job in this process, in ``run_dir`` (or the one it resumes); its exit
    code and its last line on stderr."""
    err = io.StringIO()
    where = [] if "--resume" in argv else ["--set", f"run.dir={run_dir}"]
    with contextlib.redirect_stderr(Tee(sys.stderr, err)):
        code = allhands([*argv, *QUIET, *where])
    lines = [x for x in err.getvalue().splitlines() if x.strip()]
    return code, lines[-1] if lines else ""


class Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


def resume_exact(base: list[str], out: Path) -> tuple[int, str, dict]:
    """6 steps straight, and 3 then a resume to 6 (a checkpoint every 3): the step-6 losses."""
    common = [*base, *sets(checkpoint__interval=3, checkpoint__mode="async")]
    code, last = run([*common, *sets(run__steps=6)], out / "straight")
    if code == 0:
        code, last = run([*common, *sets(run__steps=3)], out / "halves")
    if code == 0:
        code, last = run(["train", "--resume", str(out / "halves"), *common[1:],
                                    *sets(run__steps=6)], out / "halves")
    if code != 0:
        return code, last, {}
    a, b = (records(out / d)[-1]["loss"] for d in ("straight", "halves"))
    ok = a == b
    return (0 if ok else 1), ("" if ok else f"losses differ at step 6: {a!r} vs {b!r}"), \
        {"note": f"step-6 loss {a:.6f} both ways" if ok else "NOT exact"}


def records(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "loss" in r]


def summary(run_dir: Path) -> dict:
    rows = records(run_dir)
    tail = rows[WARMUP:] or rows
    med = {k: statistics.median(r[k] for r in tail) for k in ("step_time", "tokens_per_s", "mfu")
           if all(k in r for r in tail)}
    med["peak_gib"] = max(max(r["peak_mem_bytes_rank"]) for r in rows) / 2**30
    med["steps"] = len(rows)
    med["loss"] = rows[-1]["loss"]
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="CPU, toy shapes: the script's own check")
    p.add_argument("--out", type=Path, default=None, help="where the runs go (default: a new temp dir)")
    p.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    a = p.parse_args(argv)
    import torch
    if not a.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; run with --dry on CPU", file=sys.stderr)
        return 2
    ngpu = 1 if a.dry else torch.cuda.device_count()
    name = "cpu (dry)" if a.dry else f"{ngpu} x {torch.cuda.get_device_name(0)}"
    print(f"gpu_check: {name}, torch {torch.__version__}", flush=True)
    out = a.out or Path(tempfile.mkdtemp(prefix="allhands-gpu-check-"))
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    table, failed = [], False
    plan = steps(out, ngpu, a.dry)
    for step, args in plan:
        if only and step.split()[0] not in only and step not in only:
            continue
        t0 = time.perf_counter()
        if step == "resume":
            code, last, extra = resume_exact(plan[0][1], out / "resume")
        else:
            code, last = run(args, out / step.replace(" ", "-"))
            extra = summary(out / step.replace(" ", "-")) if code == 0 else {}
        failed |= code != 0
        table.append(dict(step=step, code=code, wall=time.perf_counter() - t0, last=last, **extra))
    print(f"\n{'step':<18} {'exit':>4} {'wall s':>7} {'step s':>8} {'tokens/s':>10} {'MFU':>6} "
          f"{'peak GiB':>8}  note")
    for r in table:
        if r["code"] != 0:
            print(f"{r['step']:<18} {r['code']:>4} {r['wall']:>7.1f}  {r['last'][:100]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-"
        st = f"{r['step_time']:.3f}" if "step_time" in r else "-"
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
        note = r.get("note") or (f"{r['steps']} steps, last loss {r['loss']:.4f}" if "steps" in r else "")
        print(f"{r['step']:<18} {r['code']:>4} {r['wall']:>7.1f} {st:>8} {tps:>10} {mfu:>6} {peak:>8}  {note}")
    print(f"runs in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
