"""The published runs bench/plan.py plans are entered as the sources state them: each MPT row's
model, as the planner counts its parameters, has the NumParams llm-foundry printed beside it."""

import importlib.util
from pathlib import Path

from allhands.plan.estimate import stage_params

BENCH = Path(__file__).resolve().parents[1] / "bench" / "plan.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mpt_rows_match_published_parameter_counts():
    b = _bench()
    assert len(b.MPT_H100) == 52  # every row of llm-foundry's "H100 80GB BF16" table
    for model, seq, *_, params in b.MPT_H100:
        layers, width, heads = b.MPT[model]
        cfg = b._config(f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={width}",
                        f"model.seq_len={seq}", "model.vocab_size=50368", "model.bias=true",
                        "model.tie_embeddings=true")
        assert stage_params(cfg, 1, 1, 0)[0] == params, (model, seq)
