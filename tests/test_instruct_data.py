"""Fine-tuning data: a transformers tokenizer directory (tokenizer.json + tokenizer_config.json)
for `prepare` and training, and instruction rows whose loss is on the responses only.

The tokenizer is a small byte-level BPE trained offline with the tokenizers library, saved into a
directory with a ChatML chat template (examples/tiny_hf_model.py), so nothing is downloaded."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from allhands.data import GlobalSampler, load_token_splits, load_training_data
from allhands.data.corpus import prepare_corpus
from allhands.data.examples import IGNORE
from allhands.data.tokenizer import HFTokenizer
from allhands.errors import DataError
from allhands.job import TokenMeanLoss, lm_loss
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import ROOT, cli, tiny_config
from test_parity import assert_resume_bit_exact, max_rel_diff, reference_params, trained_params

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


def _example():
    """examples/tiny_hf_model.py: its tokenizer (a BPE trained offline, a ChatML template) is
    the one these tests prepare with."""
    spec = importlib.util.spec_from_file_location("tiny_hf_model", ROOT / "examples" / "tiny_hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_HF = _example()
WORDS = TINY_HF.WORDS


def make_tokenizer_dir(d: Path, template: str | None = TINY_HF.CHATML, **config) -> Path:
    TINY_HF.make_tokenizer(d, template, **config)
    return d


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def rows(n: int, seed: int = 0) -> list[dict]:
    """Prompt/response rows and chat rows, alternating, of uneven lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            out.append({"prompt": f"Q: {sentence(rng, 1, 6)}\nA:", "response": " " + sentence(rng, 1, 8)})
        else:
            msgs = [{"role": "user", "content": sentence(rng, 1, 5)},
                    {"role": "assistant", "content": sentence(rng, 1, 6)}]
            if i % 4 == 0:
                msgs = [{"role": "system", "content": "be brief"}, *msgs,
                        {"role": "user", "content": sentence(rng, 1, 3)},
                        {"role": "assistant", "content": sentence(rng, 1, 3)}]
            out.append({"messages": msgs})
    return out


def write_jsonl(path: Path, items: list) -> Path:
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in items))
    return path


def loss_text(tok: HFTokenizer, y: torch.Tensor) -> str:
    return tok.decode([int(t) for t in y if t != IGNORE])


def expected_loss_text(row: dict) -> str:
    if "messages" in row:
        return "".join(m["content"] + "<|im_end|>\n" for m in row["messages"] if m["role"] == "assistant")
    return row["response"] + "<|im_end|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok") / "hf")


@pytest.fixture(scope="module")
def instruct_dir(tok_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("instruct")
    src = write_jsonl(root / "rows.jsonl", rows(60))
    prepare_corpus([str(src)], root / "out", tokenizer=str(tok_dir), val_fraction=0.1)
    return root / "out"


def test_exactly_the_responses_carry_loss(tok_dir, tmp_path):
    data = rows(20, seed=1)
    src = write_jsonl(tmp_path / "rows.jsonl", data)
    meta = prepare_corpus([str(src)], tmp_path / "out", tokenizer=str(tok_dir), val_fraction=0.1)
    assert meta["kind"] == "instruct" and meta["chat_template"] == "tokenizer"
    assert meta["eot_token"] == "<|im_end|>"  # the config's eos_token, not <|endoftext|>
    train, val, _ = load_token_splits(tmp_path / "out", seq_len=256)
    assert (len(train), len(val)) == (18, 2)
    tok = HFTokenizer(tmp_path / "out")  # the prepared directory is a tokenizer directory too
    for i, row in enumerate(data):
        x, y = (train[i] if i < 18 else val[i - 18])
        assert loss_text(tok, y) == expected_loss_text(row), f"row {i}"
        n = int((y != IGNORE).sum())
        assert (train if i < 18 else val).valid_targets([i if i < 18 else i - 18]) == n
        if "prompt" in row:  # the whole example, then padding (the pad token) with no loss
            assert tok.decode(x[x != meta["pad"]].tolist()) == row["prompt"] + row["response"] + "<|im_end|>"
            assert bool((y[x == meta["pad"]] == IGNORE).all())


# ChatML with transformers' assistant-mask markers around each assistant turn's content and end
GENERATION = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
              "{% if message['role'] == 'assistant' %}{% generation %}"
              "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
              "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_ids_and_mask_equal_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok_dir = make_tokenizer_dir(tmp_path / "hf", GENERATION)
    theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
    data = [r for r in rows(12, seed=2) if "messages" in r]
    src = write_jsonl(tmp_path / "rows.jsonl", data)
    prepare_corpus([str(src)], tmp_path / "out", tokenizer=str(tok_dir), val_fraction=0.2)
    train, val, _ = load_token_splits(tmp_path / "out", seq_len=256)
    for i, row in enumerate(data):
        want = theirs.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        x, y = train[i] if i < len(train) else val[i - len(train)]
        n = len(want["input_ids"])
        assert x[:n].tolist() == list(want["input_ids"][:n]), f"row {i}: ids"
        mask = (y[:n - 1] != IGNORE).long().tolist()  # y[j] is the target id j + 1
        assert mask == list(want["assistant_masks"][1:n]), f"row {i}: loss mask"


def rewriting(generation: bool) -> str:
    """A template that drops the reasoning of earlier assistant turns, as Qwen3's does."""
    a, b = ("{% generation %}", "{% endgeneration %}") if generation else ("", "")
    return ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
            "{% if m['role'] == 'assistant' %}" + a +
            "{% if loop.last %}{{ m['content'] }}{% else %}{{ m['content'].split('</think>')[-1] }}"
            "{% endif %}{{ '<|im_end|>\n' }}" + b +
            "{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}")


def test_a_template_that_rewrites_earlier_turns_needs_generation_marks(tmp_path):
    row = {"messages": [{"role": "user", "content": "the cat"},
                        {"role": "assistant", "content": "<think>a dog</think>sat on"},
                        {"role": "user", "content": "we saw"},
                        {"role": "assistant", "content": "<think>red</think>two birds"}]}
    src = write_jsonl(tmp_path / "rows.jsonl", [row, row])
    with pytest.raises(DataError, match=r"rows.jsonl' line 1: the chat template does not render"):
        prepare_corpus([str(src)], tmp_path / "refused", tokenizer=str(
            make_tokenizer_dir(tmp_path / "plain", rewriting(False))), val_fraction=0.5)
    assert not (tmp_path / "refused").exists()
    tok_dir = make_tokenizer_dir(tmp_path / "marked", rewriting(True))
    prepare_corpus([str(src)], tmp_path / "out", tokenizer=str(tok_dir), val_fraction=0.5)
    x, y = load_token_splits(tmp_path / "out", seq_len=128)[0][0]
    # the earlier turn as the whole conversation renders it, without its reasoning
    assert loss_text(HFTokenizer(tok_dir), y) == "sat on<|im_end|>\n<think>red</think>two birds<|im_end|>\n"
    transformers = pytest.importorskip("transformers")
    want = transformers.AutoTokenizer.from_pretrained(tok_dir).apply_chat_template(
        row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    n = len(want["input_ids"])
    assert x[:n].tolist() == list(want["input_ids"])
    assert (y[:n - 1] != IGNORE).long().tolist() == list(want["assistant_masks"][1:])


def test_a_long_example_is_cut_to_seq_len(instruct_dir):
    """At seq_len=16 several examples are longer than the window and their responses start
    inside it: each cut row is the first 16 positions of the uncut row (same ids, same loss
    mask, the last target the id after the window), and its counted targets are x shifted."""
    seq_len = 16
    cut, _, _ = load_token_splits(instruct_dir, seq_len=seq_len)
    whole, _, _ = load_token_splits(instruct_dir, seq_len=256)
    pad = json.loads((instruct_dir / "meta.json").read_text())["pad"]
    counted = 0
    long_ones = 0
    for i in range(len(cut)):
        x, y = cut[i]
        wx, wy = whole[i]
        assert x.shape == y.shape == (seq_len,)
        assert torch.equal(x, wx[:seq_len]) and torch.equal(y, wy[:seq_len]), f"example {i}"
        if int((wx != pad).sum()) <= seq_len:
            continue
        long_ones += 1
        keep = y != IGNORE
        counted += int(keep.sum())
        assert cut.valid_targets([i]) == int(keep.sum())
        assert torch.equal(y[:-1][keep[:-1]], x[1:][keep[:-1]])  # y is x shifted
        if keep[-1]:
            assert int(y[-1]) == int(wx[seq_len])  # the id just past the window
    assert long_ones >= 4 and counted >= 10  # the windows hold responses: the checks compared ids


def test_default_template_and_bos_from_the_config(tmp_path):
    tok_dir = make_tokenizer_dir(tmp_path / "hf", template=None, bos_token="<s>", add_bos_token=True)
    row = {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a dog"}]}
    src = write_jsonl(tmp_path / "rows.jsonl", [row, row, {"prompt": "sat", "response": " on"}])
    meta = prepare_corpus([str(src)], tmp_path / "out", tokenizer=str(tok_dir), val_fraction=0.4)
    assert meta["chat_template"] == "default" and meta["bos"] == [3]
    train, val, _ = load_token_splits(tmp_path / "out", seq_len=64)
    tok = HFTokenizer(tok_dir)
    x, y = train[0]
    assert int(x[0]) == 3  # <s>, as add_bos_token says
    assert tok.decode(x[x != meta["pad"]].tolist()).startswith("<s><|user|>\nthe cat<|im_end|>\n<|assistant|>\n")
    assert loss_text(tok, y) == "a dog<|im_end|>\n"  # Zephyr's layout: content, eos, newline
    x, y = val[0]
    assert int(x[0]) == 3 and loss_text(tok, y) == " on<|im_end|>"


def test_text_prepare_with_a_tokenizer_dir(tmp_path):
    tok_dir = make_tokenizer_dir(tmp_path / "hf", bos_token="<s>", add_bos_token=True)
    docs = [sentence(random.Random(k), 30, 60) for k in range(12)]
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    meta = prepare_corpus([str(src)], tmp_path / "out", tokenizer=str(tok_dir), workers=1,
                          progress=False)
    assert "kind" not in meta and meta["eot_token"] == "<|im_end|>" and meta["bos"] == [3]
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    tok = HFTokenizer(tok_dir)
    train, val, _ = load_token_splits(tmp_path / "out", seq_len=8)
    stream = [int(t) for split in (train, val) for shard in split.maps for t in shard]
    assert tok.decode(stream) == "".join(f"<s>{d}<|im_end|>" for d in docs)


def test_bos_from_the_post_processor_unless_the_config_says(tmp_path):
    from tokenizers import Tokenizer, processors

    d = make_tokenizer_dir(tmp_path / "hf")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))  # Llama 3's way: the post-processor adds BOS
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    tok.save(str(d / "tokenizer.json"))
    cat, sat = (tok.encode(t, add_special_tokens=False).ids for t in ("the cat", "sat"))
    assert HFTokenizer(d).prefix == [3]
    assert HFTokenizer(d).encode_docs(["the cat", "sat"]).tolist() == [3, *cat, 2, 3, *sat, 2]
    assert HFTokenizer(d / "tokenizer.json").prefix == [3]  # the bare file: the same rule
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "add_bos_token": False}))
    assert HFTokenizer(d).encode_docs(["the cat", "sat"]).tolist() == [*cat, 2, *sat, 2]


@pytest.mark.parametrize("row,message", [
    ({"prompt": "hi"}, "has no messages or prompt and response fields (it has: prompt)"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
     "message 1 has role 'bot'; allowed: system, user, assistant, tool"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"prompt": "hi", "response": 3}, "field 'response' is a int, not text"),
])
def test_a_malformed_row_is_one_line_naming_file_and_line(tok_dir, tmp_path, capfd, row, message):
    good = {"prompt": "a", "response": "b"}
    src = write_jsonl(tmp_path / "rows.jsonl", [good, "", good, row, good])
    p = cli(["prepare", src, "--tokenizer", tok_dir, "--out", tmp_path / "out"], capfd)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert f"{str(src)!r} line 4" in lines[0] and message in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_a_mixture_with_instruction_data_counts_its_targets(instruct_dir, tmp_path):
    docs = [sentence(random.Random(k), 30, 60) for k in range(12)]
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    prepare_corpus([str(src)], tmp_path / "text", tokenizer=str(instruct_dir), workers=1, progress=False)
    cfg = tiny_config(instruct_dir, tmp_path / "run", *FT, f"data.mix={instruct_dir}:1,{tmp_path / 'text'}:1",
                      "data.path=")
    train, _, _ = load_training_data(cfg)
    assert train.masked_targets
    idx = list(range(len(train)))
    assert train.valid_targets(idx) == sum(int((train[i][1] != IGNORE).sum()) for i in idx)
    assert 0 < train.valid_targets(idx) < len(idx) * 48  # text windows count whole, examples not


def test_token_mean_is_the_global_mean_over_unmasked_targets():
    torch.manual_seed(0)
    logits = torch.randn(6, 5, 11)
    y = torch.randint(0, 11, (6, 5))
    y[y % 3 == 0] = IGNORE  # uneven: the two halves hold different numbers of targets
    loss = TokenMeanLoss()
    loss.begin(int((y != IGNORE).sum()), calls=2)
    halves = [loss(logits[:3], y[:3]), loss(logits[3:], y[3:])]
    assert torch.allclose(sum(halves) / 2, lm_loss(logits, y), atol=1e-6)
    naive = (lm_loss(logits[:3], y[:3]) + lm_loss(logits[3:], y[3:])) / 2
    assert abs(float(naive - lm_loss(logits, y))) > 1e-3  # why the per-half mean is not used


FT = ["model.seq_len=48", "run.threads=1", "checkpoint.interval=2"]


LAYOUTS = {  # 2 workers each; the loss calls a step averages: ranks x micro-batches x pp chunks
    "ddp": ["run.micro_batches=2"],
    "fsdp": ["parallel.dp_shard=2", "parallel.dp_replicate=1", "parallel.zero=3"],
    "pp2-1f1b": ["parallel.pp=2", "parallel.dp_replicate=1", "parallel.pp_schedule=1f1b",
                 "parallel.pp_microbatches=3", "run.micro_batches=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_masked_data_parallel_matches_single_process(instruct_dir, tmp_path, layout):
    # SGD, as the other parity tests of a new loss: Adam's first update of a position embedding
    # that a step's batch reaches once is sign(g) * lr, which turns rounding noise into a
    # parameter difference; SGD keeps the comparison about the loss's arithmetic
    cfg = tiny_config(instruct_dir, tmp_path / "run", *FT, *LAYOUTS[layout], "optim.name=sgd",
                      "optim.lr=0.5")
    train, _, vocab = load_training_data(cfg)
    assert vocab == json.loads((instruct_dir / "meta.json").read_text())["vocab_size"] != 257
    assert train.masked_targets
    done = train_job(cfg, LaunchSpec(nproc=2))
    ref = reference_params(done)  # one process, lm_loss over each whole global batch
    got = trained_params(done)
    assert max_rel_diff(got, ref) <= 1e-5
    # the test can fail: a mean per rank's half of each batch trains to other parameters
    assert max_rel_diff(reference_params(done, shares=2), ref) > 1e-4
    torch.manual_seed(done.run.seed)
    # the evaluation is the global token mean as well: rank 0's and rank 1's val halves
    # weighted by their unmasked targets
    from allhands.job import build_reference_model

    model = build_reference_model(done, vocab)
    model.load_state_dict(got)
    _, val, _ = load_training_data(done)
    idx = GlobalSampler(len(val), done.run.global_batch, done.data.seed + 1).global_batch_indices(0)
    x, y = torch.utils.data.default_collate([val[i] for i in idx])
    with torch.no_grad():
        want = float(lm_loss(model.eval()(x), y))
    logged = [json.loads(line) for line in (Path(done.run.dir) / "metrics.jsonl").read_text().splitlines()]
    last = [r["eval_loss"] for r in logged if "eval_loss" in r][-1]
    assert abs(last - want) <= 1e-5 * max(1.0, abs(want))


def test_masked_data_resumes_bit_exact(instruct_dir, tmp_path):
    cfg = tiny_config(instruct_dir, tmp_path / "run", *FT)
    assert_resume_bit_exact(cfg, 2, tmp_path, drop_step=4, label="resume on instruction data")
