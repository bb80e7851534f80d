"""``allhands prepare``: a local corpus to token shards, tokenized in parallel processes,
with a progress bar, and continued where it stopped when run again.

The documents, in input order, are cut into chunks of about ``chunk_bytes`` of text; a pool of
worker processes tokenizes chunks and writes each as ``OUT/.prepare/chunk-K.bin`` (written
beside and renamed, so a present file is complete). Chunking depends only on the inputs, so a
second run over the same inputs and tokenizer (``.prepare/job.json``) skips the chunks it finds.
At the end the chunks are streamed into train/val shards (shards.py), the tokenizer is stored
beside them, and ``.prepare`` is removed. Chunk ``K`` always holds the same documents, so the
shards do not depend on the worker count, the input format, or interruptions.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np

from allhands.data.formats import expand_inputs, read_documents
from allhands.data.shards import write_shards
from allhands.data.tokenizer import (TOKENIZER_FILE, ByteTokenizer, HFTokenizer, load_tokenizer,
                                     tokenizer_info, train_bpe)
from allhands.errors import DataError, cannot_write

WORK = ".prepare"
JOB_VERSION = 1

_TOK = None  # the worker process's tokenizer (set by _init_worker)


def _init_worker(spec: tuple) -> None:
    global _TOK
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _TOK = load_tokenizer(*spec)


def _encode_chunk(k: int, docs: list[str], work: str) -> int:
    ids = _TOK.encode_docs(docs)
    path = Path(work) / f"chunk-{k:06d}.bin"
    tmp = path.with_suffix(".tmp")
    ids.tofile(tmp)
    os.replace(tmp, path)
    return len(ids)


def _chunks(files: list[Path], field: str, chunk_bytes: int) -> Iterator[tuple[list[str], int, int]]:
    """``(documents, bytes read on disk, characters)`` per chunk of about ``chunk_bytes``."""
    docs, disk, chars = [], 0, 0
    for path in files:
        for batch, advanced in read_documents(path, field):
            disk += advanced
            for d in batch:
                docs.append(d)
                chars += len(d)
                if chars >= chunk_bytes:
                    yield docs, disk, chars
                    docs, disk, chars = [], 0, 0
    if docs or disk:
        yield docs, disk, chars


def _fingerprint(files: list[Path], field: str, tok, chunk_bytes: int) -> dict:
    return {"version": JOB_VERSION, "field": field, "chunk_bytes": chunk_bytes,
            "tokenizer": tokenizer_info(tok),
            "inputs": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _tokenizer(files, work: Path, spec: str, train: int, field: str, eot: str):
    """The tokenizer to use: bytes, the given tokenizer.json, or a BPE trained on the inputs
    (once: a continued run reuses ``.prepare/tokenizer.json``)."""
    if not train:
        return load_tokenizer(spec, eot)
    if train < 257:
        raise DataError(f"--train-tokenizer bpe:{train}: the vocabulary must hold the 256 bytes "
                        f"and the end-of-document token; use bpe:VOCAB with VOCAB >= 257")
    trained = work / f"bpe-{train}.json"
    if not trained.is_file():
        print(f"allhands: training a byte-level BPE of {train:,} tokens on the input",
              file=sys.stderr, flush=True)
        docs = (d for p in files for batch, _ in read_documents(p, field) for d in batch)
        train_bpe(docs, train, trained.with_suffix(".tmp"))
        os.replace(trained.with_suffix(".tmp"), trained)
    return HFTokenizer(trained)


class _Bar:
    """Bytes read (with ETA), documents and tokens/s, on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.bar, self.total, self.enabled = None, total, enabled
        self.t0, self.tokens, self.docs = time.perf_counter(), 0, 0

    def update(self, disk: int, docs: int, tokens: int) -> None:
        if self.enabled and self.bar is None:  # shown from the first chunk on: an input error
            from tqdm import tqdm  # found earlier stays one line; start-up time otherwise

            self.bar = tqdm(total=self.total, unit="B", unit_scale=True, unit_divisor=1024,
                            desc="prepare", file=sys.stderr, smoothing=0.1)
        self.docs += docs
        self.tokens += tokens
        if self.bar is not None:
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.docs:,} docs, {rate / 1e6:.2f}M tok/s", refresh=False)
            self.bar.update(disk)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def prepare_corpus(inputs: list[str], out: str | os.PathLike, **kw) -> dict:
    """Tokenize ``inputs`` (files, globs, directories) into shards in ``out``; returns meta (the
    options: :func:`_prepare`). Bad input leaves no ``out`` that this call created; an interrupt
    keeps it, so that the same command continues where it stopped."""
    created = not Path(out).exists()
    try:
        return _prepare(inputs, Path(out), **kw)
    except DataError:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _prepare(inputs: list[str], out: Path, *, tokenizer: str = "byte",
             train_bpe_vocab: int = 0, field: str = "text", eot: str = "",
             val_fraction: float = 0.05, workers: int = 0, chunk_bytes: int = 4 << 20,
             shard_tokens: int = 1 << 24, progress: bool = True) -> dict:
    """``workers``: processes (0 = one per core; 1 tokenizes in this process)."""
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction: {val_fraction} is not allowed; must be in (0, 1)")
    files = expand_inputs(inputs)
    work = out / WORK
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out: {cannot_write(out, e)}; pass a writable directory") from None
    tok = _tokenizer(files, work, tokenizer, train_bpe_vocab, field, eot)
    job = _fingerprint(files, field, tok, chunk_bytes)
    job_file = work / "job.json"
    stale = list(work.glob("chunk-*"))
    if stale and job_file.is_file() and json.loads(job_file.read_text()) != job:
        print(f"allhands: {str(work)!r} holds an interrupted run over other inputs or another "
              f"tokenizer; starting over", file=sys.stderr, flush=True)
        for old in stale:
            old.unlink()
    job_file.write_text(json.dumps(job))
    dtype = np.dtype(tok.dtype)
    done = {int(p.stem[6:]): p.stat().st_size // dtype.itemsize for p in work.glob("chunk-*.bin")}
    if done:
        print(f"allhands: continuing: {len(done)} chunks of an interrupted run are done",
              file=sys.stderr, flush=True)

    workers = workers or os.cpu_count() or 1
    spec = ("byte",) if isinstance(tok, ByteTokenizer) else (str(tok.path), tok.eot_token)
    bar = _Bar(sum(p.stat().st_size for p in files), progress)
    counts: dict[int, int] = dict(done)
    chars = 0
    pool = None
    try:
        if workers > 1:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per process
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=(spec,))
        else:
            _init_worker_here(spec)
        pending: deque = deque()  # in flight, oldest first: at most 2 per worker held in memory
        for k, (docs, disk, n_chars) in enumerate(_chunks(files, field, chunk_bytes)):
            chars += n_chars
            if k in done:
                bar.update(disk, len(docs), 0)
                continue
            if pool is None:
                counts[k] = _encode_chunk(k, docs, str(work))
                bar.update(disk, len(docs), counts[k])
                continue
            pending.append((k, disk, len(docs), pool.apply_async(_encode_chunk, (k, docs, str(work)))))
            while len(pending) > 2 * workers or (pending and pending[0][3].ready()):
                k0, d0, n0, res = pending.popleft()
                counts[k0] = res.get()
                bar.update(d0, n0, counts[k0])
        while pending:
            k0, d0, n0, res = pending.popleft()
            counts[k0] = res.get()
            bar.update(d0, n0, counts[k0])
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        bar.close()
    if pool is not None:
        pool.close()
        pool.join()
    if chars == 0:
        raise DataError(f"inputs {' '.join(inputs)!r} hold no text (the corpus is empty); check "
                        f"--field and the files")
    order = sorted(counts)
    total = sum(counts.values())
    pieces = (np.fromfile(work / f"chunk-{k:06d}.bin", dtype=dtype) for k in order)
    info = tokenizer_info(tok)
    if not isinstance(tok, ByteTokenizer):
        shutil.copyfile(tok.path, out / TOKENIZER_FILE)
    meta = write_shards(out, pieces, total, info, val_fraction, shard_tokens)
    shutil.rmtree(work, ignore_errors=True)
    return meta


def _init_worker_here(spec: tuple) -> None:
    """Tokenize in this process (one worker): the tokenizer without the worker's signal set-up."""
    global _TOK
    _TOK = load_tokenizer(*spec)
