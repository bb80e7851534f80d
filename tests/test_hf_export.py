"""`allhands export --format hf`: a run on a BPE corpus leaves as a transformers GPT-2 that
`GPT2LMHeadModel.from_pretrained` opens offline with its tokenizer, and whose logits equal
the reference model's within 1e-5; `checkpoint.init_from` takes the directory back."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from allhands.checkpoint import committed, load_weights  # noqa: E402
from allhands.checkpoint.hf import write_hf  # noqa: E402
from allhands.models.gpt_hf import to_gpt2  # noqa: E402
from allhands.cli import main  # noqa: E402
from allhands.data.corpus import prepare_corpus  # noqa: E402
from allhands.data.shards import embedded_text  # noqa: E402
from allhands.data.tokenizer import EOT, byte_tokenizer_json  # noqa: E402
from allhands.launch.launcher import LaunchSpec, train_job  # noqa: E402
from allhands.trainer import build_reference_model  # noqa: E402

from conftest import tiny_config  # noqa: E402

TEXT = "Many hands make light work, and the model reads it back."


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the round trip must not need the network
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _hf_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.GPT2LMHeadModel.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad():
        return hf.eval()(ids).logits


@pytest.mark.parametrize("bias, tie", [(True, False), (False, True)])
def test_mapping_gives_the_same_logits(tmp_path, bias, tie):
    """Without processes: a random reference GPT (biases non-zero) through the name map."""
    cfg = tiny_config(tmp_path, tmp_path, f"model.bias={str(bias).lower()}",
                      f"model.tie_embeddings={str(tie).lower()}", "model.n_head=4")
    torch.manual_seed(0)
    ref = build_reference_model(cfg, 300).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))  # biases and norms away from their init
    write_hf(tmp_path / "hf", ref.state_dict(), cfg.model, 0, None)
    ids = torch.randint(0, 300, (2, cfg.model.seq_len))
    with torch.no_grad():
        want = ref(ids)
    assert torch.allclose(_hf_logits(tmp_path / "hf", ids), want, atol=1e-5, rtol=0)
    back = load_weights(build_reference_model(cfg, 300), tmp_path / "hf")
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    if not bias:
        assert not to_gpt2(ref.state_dict(), 2, 4, tie)["transformer.h.0.attn.c_attn.bias"].any()


def test_run_round_trips_through_transformers(tmp_path, capsys):
    docs = embedded_text().split("\n\n")[:600]
    data = tmp_path / "data"
    (tmp_path / "docs.txt").write_text("\n\n".join(docs))
    prepare_corpus([str(tmp_path / "docs.txt")], data, train_bpe_vocab=400, workers=1,
                   progress=False)
    cfg = tiny_config(data, tmp_path / "run", "checkpoint.interval=2")
    done = train_job(cfg, LaunchSpec(nproc=2))
    out = tmp_path / "hf"
    assert main(["export", done.run.dir, "--format", "hf", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                    "tokenizer.json", "tokenizer_config.json"]

    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = torch.tensor([tok(TEXT)["input_ids"][:cfg.model.seq_len]])
    assert tok.decode(ids[0]) == TEXT[:len(tok.decode(ids[0]))] and tok.eos_token == "<|endoftext|>"
    ref = build_reference_model(done, 400).eval()
    load_weights(ref, committed(tmp_path / "run" / "checkpoints")[-1][1])
    with torch.no_grad():
        want = ref(ids)
    assert torch.allclose(_hf_logits(out, ids), want, atol=1e-5, rtol=0)

    # checkpoint.init_from takes the directory: a new run starts from exactly these weights
    again = load_weights(build_reference_model(done, 400), out)
    for k, v in ref.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_byte_tokenizer_opens_in_transformers(tmp_path):
    """A run on bytes (the default corpus) exports the byte tokenizer as a tokenizer.json."""
    cfg = tiny_config(tmp_path, tmp_path)
    sd = build_reference_model(cfg, 257).state_dict()
    write_hf(tmp_path / "hf", sd, cfg.model, 0, (byte_tokenizer_json(), EOT, 256))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    text = "Grüße ✓ <|endoftext|>"
    assert tok(text)["input_ids"] == list("Grüße ✓ ".encode()) + [256]
    assert tok.eos_token_id == 256 and tok.decode(list("Grüße".encode())) == "Grüße"
