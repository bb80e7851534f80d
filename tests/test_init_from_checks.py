"""What ``checkpoint.init_from`` brings is checked before any worker starts, each mistake one line
(exit 2): data prepared with another tokenizer than the model's own tokenizer.json (with
``data.tokenizer_check=false`` for those who mean it), a ``model.seq_len`` beyond the positions
config.json allows (a warning where RoPE scaling stretches them), and a directory that is neither
a transformers directory nor an allhands checkpoint. The models are tiny random transformers
models made offline (examples/tiny_hf_model.py); nothing here trains."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from allhands.cli import main
from allhands.config import apply_override
from allhands.data.corpus import prepare_corpus
from allhands.data.tokenizer import byte_tokenizer_json
from allhands.errors import ConfigError
from allhands.launch.rundir import resolve_run
from allhands.models.resolve import check_tokenizer, resolve_model

from conftest import ROOT, tiny_config

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")


def _example():
    spec = importlib.util.spec_from_file_location("tiny_hf_model", ROOT / "examples" / "tiny_hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_HF = _example()


def edited(src: Path, dst: Path, **config) -> Path:
    """A copy of the transformers directory ``src`` with config.json's keys set (None: removed)."""
    shutil.copytree(src, dst)
    c = json.loads((dst / "config.json").read_text())
    for k, v in config.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Made once: the tiny Llama of examples/tiny_hf_model.py with its own tokenizer.json (320
    tokens), its chat data prepared with bytes (the issue's `allhands prepare chat.jsonl
    --tokenizer byte`) and with the model's tokenizer, variants of the model, and directories
    that are no model."""
    base = tmp_path_factory.mktemp("init-from")
    model = base / "tiny-llama"
    TINY_HF.make_model(model, TINY_HF.make_tokenizer(model))
    TINY_HF.make_chat(base / "chat.jsonl")
    for name, tok in (("byte-data", "byte"), ("model-data", str(model))):
        prepare_corpus([str(base / "chat.jsonl")], base / name, tokenizer=tok, val_fraction=0.1)
    short = edited(model, base / "short", max_position_embeddings=64)
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=1,
                               n_head=2, bos_token_id=0, eos_token_id=0)).save_pretrained(base / "gpt2")
    (base / "empty").mkdir()
    (base / "bin-only").mkdir()
    shutil.copy(model / "config.json", base / "bin-only" / "config.json")
    (base / "bin-only" / "pytorch_model.bin").write_bytes(b"")
    step = base / "run" / "checkpoints" / "step-00000002"  # what catalog.committed counts
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    return {"base": base, "model": model, "byte_data": base / "byte-data",
            "model_data": base / "model-data", "short": short, "gpt2": base / "gpt2",
            "empty": base / "empty", "bin_only": base / "bin-only", "run": base / "run"}


NEW = "{base}/never"  # a run.dir that a refused command must not create
NEITHER = ("is neither a transformers directory (config.json with model.safetensors or "
           "model.safetensors.index.json) nor an allhands checkpoint (manifest.json, as in "
           "RUN/checkpoints/step-N): ")
# (--set items, the whole error line after "allhands: error: ")
REFUSED = [
    (["data.path={byte_data}", "checkpoint.init_from={model}"],
     "data.path: '{byte_data}' was prepared with the byte tokenizer, but checkpoint.init_from "
     "'{model}' has its own tokenizer.json of 320 tokens, which reads the data's ids as other "
     "tokens (id 0 is 'Ā' in the data, '<|endoftext|>' in the model); prepare the data with "
     "--tokenizer {model}, or set data.tokenizer_check=false to train anyway"),
    (["data.path={model_data}", "checkpoint.init_from={short}"],
     "model.seq_len: 128 is longer than checkpoint.init_from's config.json "
     "max_position_embeddings=64, and the model has no RoPE scaling to cover it; set "
     "model.seq_len <= 64"),
    (["data.path={model_data}", "checkpoint.init_from={gpt2}"],
     "model.seq_len: 128 is longer than checkpoint.init_from's config.json n_positions=64, and "
     "the model has no RoPE scaling to cover it; set model.seq_len <= 64"),
    (["data.path={model_data}", "checkpoint.init_from={empty}"],
     "checkpoint.init_from: '{empty}' " + NEITHER + "it is empty; pass one of those, or a "
     ".safetensors file from `allhands export`"),
    (["data.path={model_data}", "checkpoint.init_from={bin_only}"],
     "checkpoint.init_from: '{bin_only}' " + NEITHER + "it has config.json but no safetensors "
     "weights; save the model again with save_pretrained(..., safe_serialization=True)"),
    (["data.path={model_data}", "checkpoint.init_from={run}"],
     "checkpoint.init_from: '{run}' " + NEITHER + "it is a run directory; pass one of its "
     "checkpoints, e.g. '{run}/checkpoints/step-00000002'"),
]


@pytest.mark.parametrize("items,says", REFUSED, ids=["tokenizer", "max_position_embeddings",
                                                      "n_positions", "empty-dir", "bin-only",
                                                      "run-dir"])
def test_refused_in_one_line_before_any_worker(items, says, made, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a default run.dir (runs/...) would land here
    argv = ["train", "--nproc", "2", "--set", "log.progress=false", "--set", f"run.dir={NEW}"]
    for item in items:
        argv += ["--set", item.format(**made)]
    capsys.readouterr()
    code = main([a.format(**made) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines() == ["allhands: error: " + says.format(**made)]
    assert not Path(NEW.format(**made)).exists() and list(tmp_path.iterdir()) == []


def resolved(made, tmp_path, *items: str):
    """What the launcher settles before it starts a worker (nothing written)."""
    cfg = tiny_config(made["model_data"], tmp_path / "run", *items)
    return resolve_run(cfg, resume=None, world_size=1, write=False)


def test_tokenizer_check_false_trains_anyway(made, tmp_path):
    with pytest.raises(ConfigError, match=r"^data.path: .* set data.tokenizer_check=false to"):
        resolved(made, tmp_path, f"data.path={made['byte_data']}", f"checkpoint.init_from={made['model']}")
    cfg = resolved(made, tmp_path, f"data.path={made['byte_data']}",
                   f"checkpoint.init_from={made['model']}", "data.tokenizer_check=false")
    assert cfg.data.tokenizer_check is False and cfg.model.family == "llama"
    # no checkpoint.init_from: nothing to compare ("" is no directory, not the working one)
    assert resolved(made, tmp_path, f"data.path={made['byte_data']}").checkpoint.init_from == ""


def checked(data: Path, model: Path) -> None:
    cfg = tiny_config(data, Path("unused"), f"checkpoint.init_from={model}")
    check_tokenizer(cfg)


def test_the_models_own_tokenizer_passes_however_it_was_saved(made, tmp_path):
    checked(made["model_data"], made["model"])  # prepared with --tokenizer MODEL_DIR
    # the same tokenizer saved otherwise (another key order and indentation, as another version
    # of the tokenizers library writes it): the same ids, so no refusal, where a file hash would
    resaved = edited(made["model"], tmp_path / "resaved")
    tok = json.loads((resaved / "tokenizer.json").read_text())
    (resaved / "tokenizer.json").write_text(json.dumps(tok, indent=4, sort_keys=True))
    checked(made["model_data"], resaved)
    # an instruct release that adds chat tokens after the data's: the data's ids mean the same
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 320, "content": "<|tool|>"})
    (resaved / "tokenizer.json").write_text(json.dumps(tok))
    checked(made["model_data"], resaved)
    # a model without a tokenizer.json: nothing to compare
    bare = tmp_path / "bare"
    shutil.copytree(made["model"], bare)
    (bare / "tokenizer.json").unlink()
    checked(made["byte_data"], bare)


def test_the_byte_tokenizer_passes_with_a_model_exported_from_bytes(made, tmp_path):
    """`allhands export --format hf` of a byte-level run writes the byte tokenizer as a
    tokenizer.json: byte data fine-tunes it; data of another tokenizer does not."""
    exported = tmp_path / "exported"
    shutil.copytree(made["model"], exported)
    (exported / "tokenizer.json").write_text(byte_tokenizer_json())
    checked(made["byte_data"], exported)
    with pytest.raises(ConfigError) as e:
        checked(made["model_data"], exported)
    assert "was prepared with a tokenizer.json of 320 tokens, but checkpoint.init_from" in str(e.value)
    assert "has its own tokenizer.json of 257 tokens" in str(e.value)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_rope_scaling_makes_a_longer_seq_len_a_warning(key, made, tmp_path):
    """Both spellings, transformers 5's rope_parameters and transformers 4's rope_scaling."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    if key == "rope_parameters":
        config = {"rope_parameters": {**rope, "rope_theta": 10000.0}}
    else:
        config = {"rope_parameters": None, "rope_scaling": rope, "rope_theta": 10000.0}
    scaled = edited(made["model"], tmp_path / "scaled", max_position_embeddings=64, **config)
    cfg = tiny_config(made["model_data"], tmp_path / "run", f"checkpoint.init_from={scaled}",
                      "model.seq_len=128")
    lines: list[str] = []
    out = resolve_model(cfg, say=lines.append)
    assert lines == ["allhands: warning: model.seq_len=128 is longer than checkpoint.init_from's "
                     "config.json max_position_embeddings=64; its RoPE scaling (llama3, factor 8) "
                     "is meant to stretch the positions, so the run goes on"]
    assert out.model.seq_len == 128 and out.model.rope_scaling == "llama3"
    # within the positions: nothing to say
    apply_override(cfg, "model.seq_len=64")
    resolve_model(cfg, say=lines.append)
    assert len(lines) == 1


def test_the_field_is_in_the_config_tree():
    from allhands.config import Config

    field = {f.name: f for f in dataclasses.fields(Config().data)}["tokenizer_check"]
    assert field.default is True and field.metadata.get("doc")
