"""`allhands prepare` throughput against the tokenizer alone, side by side on this machine.

Generates a JSON-lines corpus of ``--mb`` MB (default 200) under ``--dir`` (never committed) by
shuffling paragraphs of the embedded corpus with seeded word-level edits, trains a byte-level
BPE of ``--vocab`` ids on its first 10 MB, then, ``--repeat`` times, for the byte and the BPE
tokenizer in turn times:

- library: the tokenizer alone on the documents already in memory, in its fastest batch call:
  for BPE, tokenizers' ``Tokenizer.encode_batch_fast`` on ``--workers`` threads (its own
  thread pool, RAYON_NUM_THREADS); for bytes, the fastest numpy conversion found
  (``ByteTokenizer.encode_docs``: one join, one widening), in one process;
- prepare: ``prepare_corpus`` end to end from the file, in a fresh process as the CLI runs it:
  reading and parsing the JSON lines and tokenizing in ``--workers`` processes, writing the
  chunks and the final shards (the process start itself is not counted).

Prints wall and CPU seconds (user + system, worker processes included), MB/s of text (UTF-8
bytes of the documents) and tokens/s for each, prepare / library (wall) per round and the median
ratio. On a machine whose cores are busy, extra processes of one session get little more CPU
(Linux autogroup shares CPU between sessions), so the CPU seconds tell the work apart from the
contention. Target: prepare >= 0.8 x library. ``--bpe-mb`` times BPE on the
corpus' first MB only (BPE is ~100x slower than bytes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import random
import resource
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


def head(corpus: Path, docs: list[str], mb: int, d: Path) -> tuple[Path, list[str]]:
    """The corpus' first ``mb`` MB of lines as a file of its own, and their documents."""
    path = d / f"{corpus.stem}-head-{mb}mb.jsonl"
    with open(corpus, "rb") as f:
        lines = []
        size = 0
        for line in f:
            if size >= mb * 1e6:
                break
            lines.append(line)
            size += len(line)
    if not path.is_file():
        path.write_bytes(b"".join(lines))
    return path, docs[:len(lines)]


def cpu_s() -> float:
    """CPU seconds (user + system) of this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def time_library(tok, docs: list[str], batch: int = 4096) -> tuple[float, int, float]:
    """The tokenizer alone: the library's batch call (for BPE, without the numpy conversion
    that prepare does as well)."""
    enc = getattr(tok, "tok", None)
    if enc is not None:
        enc = getattr(enc, "encode_batch_fast", enc.encode_batch)
    t0, n, c0 = time.perf_counter(), 0, cpu_s()
    for i in range(0, len(docs), batch):
        if enc is None:
            n += len(tok.encode_docs(docs[i:i + batch]))
        else:
            n += sum(len(e.ids) + 1 for e in enc(docs[i:i + batch], add_special_tokens=False))
    return time.perf_counter() - t0, n, cpu_s() - c0


def time_prepare(corpus: Path, out: Path, tokenizer: str, workers: int) -> tuple[float, int, float]:
    """``prepare_corpus`` timed in a fresh process, as ``allhands prepare`` runs: forked from this
    one, which holds the whole corpus as strings, its workers would pay for that memory
    (copy-on-write and tearing it down: ~0.7 s of CPU per 20 MB of BPE input here)."""
    shutil.rmtree(out, ignore_errors=True)
    line = subprocess.run([sys.executable, __file__, "--prepare-only", str(corpus), str(out),
                           tokenizer, str(workers)], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    shutil.rmtree(out, ignore_errors=True)
    got = json.loads(line)
    return got["s"], got["tokens"], got["cpu"]


def prepare_only(corpus: str, out: str, tokenizer: str, workers: str) -> None:
    t0, c0 = time.perf_counter(), cpu_s()
    meta = prepare_corpus([corpus], out, tokenizer=tokenizer, workers=int(workers), progress=False)
    dt, cpu = time.perf_counter() - t0, cpu_s() - c0
    tokens = sum(e["tokens"] for split in meta["splits"].values() for e in split)
    print(json.dumps({"s": dt, "tokens": tokens, "cpu": cpu}))


def main() -> None:
    if sys.argv[1:2] == ["--prepare-only"]:  # the prepare half, in a process of its own
        return prepare_only(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB (default 200)")
    ap.add_argument("--dir", default=".bench-prepare", help="where the corpus goes")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    ap.add_argument("--workers", type=int, default=0, help="prepare's processes (0 = one per core)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--bpe-mb", type=int, default=0, help="time BPE on the first MB only (0: all)")
    ap.add_argument("--only", choices=("byte", "bpe"), help="time one tokenizer only")
    args = ap.parse_args()
    workers = args.workers or os.cpu_count() or 1
    # tokenizers' thread pool: as many threads as prepare has processes; read when the pool starts
    os.environ["RAYON_NUM_THREADS"] = str(workers)
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    corpus = d / f"corpus-{args.mb}mb.jsonl"
    make_corpus(corpus, args.mb)
    docs = load_docs(corpus)
    bpe = d / f"bpe-{args.vocab}.json"
    if not bpe.is_file():
        sample, size = [], 0
        for t in docs:
            sample.append(t)
            size += len(t)
            if size > 10e6:
                break
        train_bpe(sample, args.vocab, bpe)
    bpe_corpus, bpe_docs = head(corpus, docs, args.bpe_mb, d) if args.bpe_mb else (corpus, docs)
    print(f"corpus {corpus} ({corpus.stat().st_size / 1e6:.0f} MB on disk, {len(docs):,} "
          f"documents); {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; prepare workers "
          f"{workers}, tokenizers threads {workers}")
    print(f"{'tokenizer':<10} {'round':>5} {'what':<8} {'MB':>5} {'s':>7} {'cpu s':>7} {'MB/s':>8} "
          f"{'Mtok/s':>8} {'ratio':>6}")
    runs = [("byte", "byte", ByteTokenizer(), corpus, docs),
            (f"bpe-{args.vocab}", str(bpe), HFTokenizer(bpe), bpe_corpus, bpe_docs)]
    runs = [r for r in runs if args.only is None or r[0].startswith(args.only)]
    ratios: dict[str, list[float]] = {r[0]: [] for r in runs}
    for rnd in range(args.repeat):
        for name, spec, tok, path, texts in runs:
            text_mb = sum(len(t.encode()) for t in texts) / 1e6
            lib_s, lib_n, lib_cpu = time_library(tok, texts)
            prep_s, prep_n, prep_cpu = time_prepare(path, d / f"out-{name}", spec, workers)
            assert prep_n == lib_n, (prep_n, lib_n)  # the same tokens, counted both ways
            ratios[name].append(lib_s / prep_s)
            for what, s, cpu in (("library", lib_s, lib_cpu), ("prepare", prep_s, prep_cpu)):
                print(f"{name:<10} {rnd:>5} {what:<8} {text_mb:5.0f} {s:7.2f} {cpu:7.2f} {text_mb / s:8.1f} "
                      f"{lib_n / s / 1e6:8.2f} {lib_s / s if what == 'prepare' else 1.0:6.2f}",
                      flush=True)
    for name, r in ratios.items():
        print(f"{name}: prepare / library per round {' '.join(f'{x:.2f}' for x in r)}; "
              f"median {statistics.median(r):.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
