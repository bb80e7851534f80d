"""`allhands prepare` throughput against the tokenizer alone, side by side on this machine.

Generates a JSON-lines corpus of ``--mb`` MB (default 200) under ``--dir`` (never committed) by
shuffling paragraphs of the embedded corpus with seeded word-level edits, trains a byte-level
BPE of ``--vocab`` ids on its first 10 MB, then for the byte and the BPE tokenizer times:

- library: the tokenizer alone on the documents already in memory, in its batch call
  (tokenizers' ``encode_batch_fast``, which uses every core through its own thread pool; for
  bytes, ``ByteTokenizer.encode_docs``, numpy in one process);
- prepare: ``prepare_corpus`` end to end from the file: reading and parsing JSON, tokenizing in
  ``--workers`` processes, writing chunks and the final shards.

Prints MB/s of text (UTF-8 bytes of the documents) and tokens/s for each, and prepare / library.
Target: prepare >= 0.8 x library.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path

from allhands.data.corpus import prepare_corpus
from allhands.data.shards import embedded_text
from allhands.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe


def make_corpus(path: Path, mb: int) -> None:
    if path.is_file() and path.stat().st_size >= mb * 1e6:
        return
    paras = [p for p in embedded_text().split("\n\n") if p.strip()]
    rng = random.Random(0)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        size = 0
        while size < mb * 1e6:
            words = " ".join(rng.sample(paras, 4)).split(" ")
            rng.shuffle(words)  # new documents, the corpus' own vocabulary and statistics
            line = json.dumps({"text": " ".join(words)}) + "\n"
            size += len(line.encode())
            f.write(line)
    os.replace(tmp, path)


def load_docs(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def time_library(tok, docs: list[str], batch: int = 4096) -> tuple[float, int]:
    t0, n = time.perf_counter(), 0
    for i in range(0, len(docs), batch):
        n += len(tok.encode_docs(docs[i:i + batch]))
    return time.perf_counter() - t0, n


def time_prepare(corpus: Path, out: Path, tokenizer: str, workers: int) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    meta = prepare_corpus([str(corpus)], out, tokenizer=tokenizer, workers=workers, progress=False)
    dt = time.perf_counter() - t0
    return dt, sum(e["tokens"] for split in meta["splits"].values() for e in split)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB (default 200)")
    ap.add_argument("--dir", default="/tmp/allhands-bench-prepare", help="where the corpus goes")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    ap.add_argument("--workers", type=int, default=0, help="prepare's processes (0 = one per core)")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    corpus = d / f"corpus-{args.mb}mb.jsonl"
    make_corpus(corpus, args.mb)
    docs = load_docs(corpus)
    text_mb = sum(len(t.encode()) for t in docs) / 1e6
    bpe = d / f"bpe-{args.vocab}.json"
    if not bpe.is_file():
        sample, size = [], 0
        for t in docs:
            sample.append(t)
            size += len(t)
            if size > 10e6:
                break
        train_bpe(sample, args.vocab, bpe)
    print(f"corpus {corpus} ({corpus.stat().st_size / 1e6:.0f} MB on disk, {text_mb:.0f} MB of "
          f"text, {len(docs):,} documents); {os.cpu_count()} cores; prepare workers "
          f"{args.workers or os.cpu_count()}")
    print(f"{'tokenizer':<10} {'what':<8} {'s':>7} {'MB/s':>8} {'Mtok/s':>8} {'vs library':>10}")
    for name, spec, tok in (("byte", "byte", ByteTokenizer()),
                            (f"bpe-{args.vocab}", str(bpe), HFTokenizer(bpe))):
        lib_s, lib_n = time_library(tok, docs)
        prep_s, prep_n = time_prepare(corpus, d / f"out-{name}", spec, args.workers)
        assert prep_n == lib_n, (prep_n, lib_n)  # the same tokens, counted both ways
        for what, s in (("library", lib_s), ("prepare", prep_s)):
            print(f"{name:<10} {what:<8} {s:7.1f} {text_mb / s:8.1f} {lib_n / s / 1e6:8.2f} "
                  f"{lib_s / s if what == 'prepare' else 1.0:10.2f}")


if __name__ == "__main__":
    main()
