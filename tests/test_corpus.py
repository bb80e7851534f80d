"""`allhands prepare` on a local corpus: every input format and tokenizer end to end on small
files written here, identical shards whatever the format or worker count, continuing an
interrupted run, and one-line errors (exit 2) for bad inputs."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from allhands.cli import main
from allhands.data import load_token_splits
from allhands.data.corpus import WORK, prepare_corpus
from allhands.data.shards import embedded_text
from allhands.data.tokenizer import ByteTokenizer, HFTokenizer, byte_tokenizer_json

DOCS = embedded_text().split("\n\n")[:400] + ["Grüße, 世界! ✓", ""]


def _stream(out) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.fromfile(out / e["file"], dtype=meta["dtype"])
                           for split in ("train", "val") for e in meta["splits"][split]])


def _docs(stream: np.ndarray, eot: int) -> list[np.ndarray]:
    """The documents of ``stream``, each without its end-of-document token."""
    return [p[:-1] for p in np.split(stream, np.flatnonzero(stream == eot) + 1)[:-1]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents as .txt files, .jsonl(.gz/.zst), parquet and a saved dataset."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "txt").mkdir()
    for i, t in enumerate(DOCS):
        (d / "txt" / f"{i:04d}.txt").write_text(t, encoding="utf-8")
    lines = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(DOCS)).encode()
    (d / "a.jsonl").write_bytes(lines)
    (d / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (d / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), d / "a.parquet",
                   row_group_size=64)
    return d


def test_every_format_gives_the_same_shards(corpus, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(corpus / "saved"), max_shard_size="20KB")
    ref = None
    for i, inputs in enumerate([[str(corpus / "txt")], [str(corpus / "txt" / "*.txt")],
                                [str(corpus / "a.jsonl")], [str(corpus / "a.jsonl.gz")],
                                [str(corpus / "a.jsonl.zst")], [str(corpus / "a.parquet")],
                                [str(corpus / "saved")]]):
        out = tmp_path / str(i)
        # small chunks and 2 processes: chunking and parallelism must not show in the shards
        prepare_corpus(inputs, out, workers=1 + i % 2, chunk_bytes=20_000, progress=False)
        stream = _stream(out)
        if ref is None:
            ref = stream
            tok = ByteTokenizer()
            assert [tok.decode(p) for p in _docs(stream, tok.eot)] == DOCS
        assert np.array_equal(stream, ref), inputs


def test_bpe_trained_and_given_tokenizer(corpus, tmp_path):
    meta = prepare_corpus([str(corpus / "a.jsonl")], tmp_path / "bpe", train_bpe_vocab=600,
                          workers=2, chunk_bytes=30_000, progress=False)
    assert meta["tokenizer"] == "hf" and meta["vocab_size"] == 600 and meta["dtype"] == "uint16"
    tok = HFTokenizer(tmp_path / "bpe" / "tokenizer.json")
    stream = _stream(tmp_path / "bpe")
    assert len(stream) < 0.6 * sum(len(t.encode()) for t in DOCS)  # BPE compresses the text
    assert [tok.decode(p) for p in _docs(stream, meta["eot"])] == DOCS
    # the stored tokenizer, given back, reproduces the shards; the vocabulary flows to training
    again = prepare_corpus([str(corpus / "a.parquet")], tmp_path / "again", workers=1,
                           tokenizer=str(tmp_path / "bpe" / "tokenizer.json"), progress=False)
    assert np.array_equal(_stream(tmp_path / "again"), stream)
    assert again["tokenizer_id"] == meta["tokenizer_id"]
    train, val, m = load_token_splits(tmp_path / "again", seq_len=16)
    assert int(train[0][0].max()) < 600 and m["vocab_size"] == 600


def test_large_vocabulary_uses_uint32(corpus, tmp_path):
    import tokenizers

    tok = tokenizers.Tokenizer.from_str(byte_tokenizer_json())
    tok.add_special_tokens([f"<extra_{i}>" for i in range(70_000)])
    tok.save(str(tmp_path / "big.json"))
    meta = prepare_corpus([str(corpus / "a.parquet")], tmp_path / "out", workers=1,
                          tokenizer=str(tmp_path / "big.json"), progress=False)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_257
    # the byte tokenizer written as tokenizer.json gives the byte tokenizer's ids
    assert np.array_equal(_stream(tmp_path / "out"), ByteTokenizer().encode_docs(DOCS))


def test_continue_reuses_finished_chunks(corpus, tmp_path, monkeypatch):
    import allhands.data.corpus as corpus_mod

    out, inputs = tmp_path / "out", [str(corpus / "a.jsonl")]
    calls, real = [], corpus_mod._encode_chunk

    def interrupt_after_two(k, *args):  # Ctrl-C while the third chunk is tokenized
        calls.append(k)
        if calls == [0, 1, 2]:
            raise KeyboardInterrupt
        return real(k, *args)

    monkeypatch.setattr(corpus_mod, "_encode_chunk", interrupt_after_two)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(inputs, out, workers=1, chunk_bytes=10_000, progress=False)
    assert sorted(p.name for p in (out / WORK).glob("chunk-*.bin")) == ["chunk-000000.bin",
                                                                      "chunk-000001.bin"]
    calls.clear()
    prepare_corpus(inputs, out, workers=1, chunk_bytes=10_000, progress=False)
    assert calls[0] == 2  # chunks 0 and 1 were not tokenized again
    ref = prepare_corpus(inputs, tmp_path / "ref", workers=1, chunk_bytes=10_000, progress=False)
    assert np.array_equal(_stream(out), _stream(tmp_path / "ref")) and ref["vocab_size"] == 257


@pytest.mark.parametrize("args, message", [
    (["a.jsonl", "--field", "body"], "line 1 has no field 'body' (it has: id, text); pass --field"),
    (["a.parquet", "--column", "id"], "column 'id' holds int64, not text"),
    (["a.jsonl", "--field", "id"], "field 'id' is a int, not text"),
    (["empty"], "hold no text (the corpus is empty)"),
    (["a.jsonl", "--tokenizer", "bad.json"], "does not parse"),
    (["a.jsonl", "--train-tokenizer", "bpe:100"], "VOCAB >= 257"),
    (["a.jsonl", "--train-tokenizer", "wordpiece"], "use bpe:VOCAB"),
    (["missing.jsonl"], "'missing.jsonl' does not exist"),
])
def test_bad_inputs_are_one_line_and_exit_2(corpus, tmp_path, monkeypatch, capsys, args, message):
    (corpus / "empty").mkdir(exist_ok=True)
    (corpus / "empty" / "blank.txt").write_text("")
    (corpus / "bad.json").write_text('{"model": ')
    monkeypatch.chdir(corpus)
    assert main(["prepare", *args, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_vocabulary_larger_than_the_model_is_refused_before_launch(corpus, tmp_path, capsys):
    prepare_corpus([str(corpus / "a.jsonl")], tmp_path / "bpe", train_bpe_vocab=600, workers=1,
                   progress=False)
    capsys.readouterr()
    assert main(["train", "--set", f"data.path={tmp_path / 'bpe'}", "--set", "model.vocab_size=300",
                 "--set", f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size: 300 is smaller than the vocabulary 600" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


# Blocks of JSON lines: msgspec's fast path must give json's documents, or decline so that json
# gives them or its exact error (two values on a line, one value over two lines, both at once).
BLOCKS = [b'{"text": "a \\"q\\" \\u00e9\\n\\ud83d\\ude00", "n": 1e999}\n{"id": 2, "text": ""}\n',
          b'{"text": "no final line end"}', b'{"text": "a", "text": "dup"}\n\n  \n{"text": "b"}\r\n',
          b'{"text": "x", "n": NaN}\n', b'{"text": "a"} {"text": "b"}\n', b'{"text":\n"a"}\n',
          b'{"text": "a"} {"text": "b"}\n{"text":\n"c"}\n', b'{"text": 5}\n', b'[1]\n', b'']


@pytest.mark.parametrize("block", BLOCKS)
def test_json_lines_decoded_as_json_does(block, tmp_path):
    from allhands.data.formats import _fast_docs, jsonl_docs
    from allhands.errors import DataError

    lines = block.split(b"\n")
    try:
        want = [json.loads(line)["text"] for line in lines if line.strip()]
        want = want if all(isinstance(t, str) for t in want) else None
    except (ValueError, KeyError, TypeError):
        want = None
    if want is None:
        with pytest.raises(DataError, match="line 1[0-9][ :]"):  # numbered from first_line=10
            jsonl_docs(tmp_path / "x.jsonl", block, "text", 10)
    else:
        assert jsonl_docs(tmp_path / "x.jsonl", block, "text", 10) == want
    fast = _fast_docs(block, "text")
    assert fast is None or fast == want
    if block.startswith(b'{"text": "a \\"q') or block.startswith(b'{"text": "no'):
        assert fast == want  # the common case takes the fast path


def test_byte_ranges_and_error_lines_across_chunks(corpus, tmp_path):
    from allhands.data.formats import jsonl_ranges
    from allhands.errors import DataError

    path = corpus / "a.jsonl"
    data = path.read_bytes()
    for size in (1, 37, 5000, len(data) + 10):
        ranges = list(jsonl_ranges(path, size))
        assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
        assert all(a[1] == b[0] and data[a[1] - 1:a[1]] == b"\n" for a, b in zip(ranges, ranges[1:]))
    lines = data.splitlines(keepends=True)
    lines[300] = b'{"id": 300, "txt": "oops"}\n'
    (tmp_path / "bad.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(DataError, match="line 301 has no field 'text'"):
        prepare_corpus([str(tmp_path / "bad.jsonl")], tmp_path / "out", workers=1,
                       chunk_bytes=7_000, progress=False)


def test_shards_copied_from_chunk_files_equal_shards_written_from_arrays(tmp_path):
    from allhands.data.shards import write_shards, write_shards_from_files
    from allhands.data.tokenizer import tokenizer_info

    stream = np.random.default_rng(0).integers(0, 257, 10_000, dtype=np.uint16)
    files = []
    for i, piece in enumerate(np.split(stream, [1, 1, 3000, 7777])):  # an empty piece too
        piece.tofile(tmp_path / f"c{i}.bin")
        files.append((tmp_path / f"c{i}.bin", len(piece)))
    info = tokenizer_info(ByteTokenizer())
    a = write_shards(tmp_path / "a", [stream[:4000], stream[4000:]], len(stream), info, 0.1, 2048)
    b = write_shards_from_files(tmp_path / "b", files, info, 0.1, 2048)
    assert a == b and len(a["splits"]["train"]) == 5
    for e in a["splits"]["train"] + a["splits"]["val"]:
        assert (tmp_path / "a" / e["file"]).read_bytes() == (tmp_path / "b" / e["file"]).read_bytes()
    assert len(ByteTokenizer().encode_docs([])) == 0
