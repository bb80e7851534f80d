"""bench/gpu_check.py, the first run on a GPU, in its dry mode: the same steps (the default job,
Llama 3 8B's shape under FSDP with selective activation checkpointing eager and compiled,
document-masked packing, a mixture of experts, an exact resume) on CPU at toy shapes, so that
the script a GPU machine runs once cannot rot between those runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from conftest import ROOT

# What a GPU machine with torch alone lacks: allhands' other requirements and its extras.
NOT_ON_A_BARE_MACHINE = ["safetensors", "tqdm", "matplotlib", "tokenizers", "transformers",
                         "tensorboard", "wandb", "mlflow", "pyarrow", "zstandard", "msgspec", "jinja2"]


def test_every_step_of_the_gpu_check_runs_in_its_dry_mode(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    code = gpu_check.main(["--dry", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    table = out[out.index("\nstep "):].splitlines()[2:]
    rows = {line[:18].strip(): line.split() for line in table if line and not line.startswith("runs in")}
    assert code == 0, out
    assert list(rows) == ["default", "llama8b eager", "llama8b compiled", "packed", "moe", "resume"], out
    assert all(r[len(name.split())] == "0" for name, r in rows.items()), out
    assert "both ways" in " ".join(rows["resume"]), out
    # the compiled Llama step said what it compiled (the first step's record)
    first = next(json.loads(line) for line in (tmp_path / "llama8b-compiled" / "metrics.jsonl").open()
                 if '"compile_graphs"' in line)
    assert first["compile_graphs"] >= 1, first
    # the dry mode's backend (aot_eager) reached the worker: no graph went through inductor
    assert first["compile_cache_hits"] + first["compile_cache_misses"] == 0, first


def test_training_imports_nothing_but_torch_and_numpy(cli_env):
    """bench/gpu_check.sh runs on a machine with torch and nothing installed: the launcher, the
    worker and the trainer import with every other package absent (exporting weights, the PNG
    report, trackers and tokenizers import theirs when used; the progress bar falls back to
    plain lines without tqdm)."""
    code = ("import sys\n"
            f"for name in {NOT_ON_A_BARE_MACHINE!r}:\n"
            "    sys.modules[name] = None\n"
            "import allhands.launch.launcher, allhands.worker, allhands.trainer, allhands.cli\n"
            "from allhands.metrics import MetricsWriter\n")
    r = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
