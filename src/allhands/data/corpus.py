"""``allhands prepare``: a local corpus to token shards, read and tokenized in parallel
processes, with a progress bar, and continued where it stopped when run again.

The inputs, in order, are cut into chunks of about ``chunk_bytes``: byte ranges of whole lines of
an uncompressed JSON-lines file (the main process reads only the bytes around each cut), blocks
of decompressed lines, or documents of text, parquet and Arrow files. A pool of worker
processes reads, parses and tokenizes each chunk and writes it as ``OUT/.prepare/chunk-K.bin``
(written beside and renamed, so a present file is complete; ``chunk-K.json`` beside it counts its
documents). Chunking depends only on the inputs, so a second run over the same inputs and
tokenizer (``.prepare/job.json``) skips the chunks it finds. At the end the kernel copies the
chunks into train/val shards (shards.py), the tokenizer is stored beside them, and
``.prepare`` is removed. The shards do not depend on the worker count, the input format, or
interruptions.
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

from allhands.data.formats import (expand_inputs, is_jsonl, is_plain_jsonl, jsonl_blocks, jsonl_docs,
                                   jsonl_ranges, read_documents, read_range)
from allhands.data.instruct import looks_instruct, prepare_instruct
from allhands.data.shards import write_shards_from_files
from allhands.data.tokenizer import (ByteTokenizer, HFTokenizer, load_tokenizer, store_tokenizer,
                                     tokenizer_info, train_bpe)
from allhands.errors import DataError, cannot_write

WORK = ".prepare"
JOB_VERSION = 2  # 2: chunks of byte ranges and line blocks

_TOK = None  # the worker process's tokenizer (set by _init_worker)


def _init_worker(spec: tuple) -> None:
    global _TOK
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # A forked worker inherits its parent's handlers; one that a launch in the same process
    # installed (torch's agent raises on SIGTERM/SIGHUP/SIGQUIT) would keep the pool's terminate
    # from ending it, and the pool would wait for it forever.
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, signal.SIG_DFL)
    _TOK = load_tokenizer(*spec)


def _encode_chunk(k: int, pieces: list[tuple], field: str, work: str) -> tuple[int, int, int]:
    """Tokenize chunk ``k``; ``(tokens, documents, 1 if any document holds text else 0)``."""
    docs = _piece_docs(pieces[0], field) if len(pieces) == 1 else \
        [d for piece in pieces for d in _piece_docs(piece, field)]
    ids = _TOK.encode_docs(docs)
    path = Path(work) / f"chunk-{k:06d}.bin"
    stats = (len(ids), len(docs), int(any(docs)))
    path.with_suffix(".json").write_text(json.dumps(stats))
    with open(path.with_suffix(".tmp"), "wb") as f:
        f.write(ids.data)  # one write call: ndarray.tofile takes about 3x as long here
    os.replace(path.with_suffix(".tmp"), path)
    return stats


def _piece_docs(piece: tuple, field: str) -> list[str]:
    kind, *args = piece
    if kind == "range":
        path, start, end = Path(args[0]), args[1], args[2]
        return jsonl_docs(path, read_range(path, start, end), field, start=start)
    if kind == "lines":
        return jsonl_docs(Path(args[0]), args[1], field, args[2])
    return args[0]


def _file_pieces(path: Path, field: str, size: int) -> Iterator[tuple[tuple, int, int]]:
    """``(piece, its size, bytes advanced on disk)``: what a worker is sent of ``path``."""
    if is_plain_jsonl(path):  # the worker reads the range itself
        for start, end in jsonl_ranges(path, size):
            yield ("range", str(path), start, end), end - start, end - start
    elif is_jsonl(path):  # decompressed here, parsed there
        for data, line, advanced in jsonl_blocks(path, size):
            yield ("lines", str(path), data, line), len(data), advanced
    else:
        for docs, advanced in read_documents(path, field):
            yield ("docs", docs), sum(map(len, docs)), advanced


def _chunks(files: list[Path], field: str, chunk_bytes: int) -> Iterator[tuple[list[tuple], int]]:
    """``(pieces, bytes read on disk)`` per chunk of about ``chunk_bytes``."""
    pieces, size, disk = [], 0, 0
    for path in files:
        for piece, n, advanced in _file_pieces(path, field, chunk_bytes):
            pieces.append(piece)
            size, disk = size + n, disk + advanced
            if size >= chunk_bytes:
                yield pieces, disk
                pieces, size, disk = [], 0, 0
    if pieces or disk:
        yield pieces, disk


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


def prepare_corpus(inputs: list[str], out: str | os.PathLike, *, format: str = "auto", **kw) -> dict:
    """Tokenize ``inputs`` (files, globs, directories) into shards in ``out``; returns meta (the
    options: :func:`_prepare`). ``format``: ``text``, ``instruct`` (instruct.py) or ``auto``
    (instruct when the first row has ``messages`` or ``prompt``). Bad input leaves no ``out``
    that this call created; an interrupt keeps it, so that the same command continues where it
    stopped (text only: instruction data is small enough to redo)."""
    if kw.get("train_bpe_vocab") and kw.get("tokenizer", "byte") != "byte":
        raise DataError("--train-tokenizer: trains a new tokenizer; drop --tokenizer or this option")
    created = not Path(out).exists()
    try:
        if format == "instruct" or (format == "auto" and looks_instruct(inputs)):
            if kw.get("train_bpe_vocab"):
                raise DataError("--train-tokenizer: instruction data is tokenized with the model's "
                                "tokenizer; pass --tokenizer HF_DIR instead")
            return prepare_instruct(inputs, Path(out), tokenizer=kw.get("tokenizer", "byte"),
                                    eot=kw.get("eot", ""), val_fraction=kw.get("val_fraction", 0.05))
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
    # a chunk's .json (tokens, documents, any text) is written before its .bin is renamed
    done = {int(p.stem[6:]): json.loads(p.with_suffix(".json").read_text())
            for p in work.glob("chunk-*.bin")}
    if done:
        print(f"allhands: continuing: {len(done)} chunks of an interrupted run are done",
              file=sys.stderr, flush=True)

    workers = workers or os.cpu_count() or 1
    spec = ("byte",) if isinstance(tok, ByteTokenizer) else (str(tok.dir or tok.path), tok.eot_token)
    bar = _Bar(sum(p.stat().st_size for p in files), progress)
    stats: dict[int, list[int]] = dict(done)
    pool = None

    def collect(k: int, disk: int, result) -> None:
        stats[k] = result.get() if pool is not None else result
        bar.update(disk, stats[k][1], stats[k][0])

    try:
        if workers > 1:
            pool = _pool(workers, spec)
        else:
            _init_worker_here(spec)
        pending: deque = deque()  # in flight, oldest first: at most 2 per worker held in memory
        for k, (pieces, disk) in enumerate(_chunks(files, field, chunk_bytes)):
            if k in done:
                bar.update(disk, done[k][1], 0)
            elif pool is None:
                collect(k, disk, _encode_chunk(k, pieces, field, str(work)))
            else:
                pending.append((k, disk, pool.apply_async(_encode_chunk, (k, pieces, field, str(work)))))
            while len(pending) > 2 * workers or (pending and pending[0][2].ready()):
                collect(*pending.popleft())
        while pending:
            collect(*pending.popleft())
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        bar.close()
    if pool is not None:
        pool.close()
        pool.join()
    if not sum(s[2] for s in stats.values()):
        raise DataError(f"inputs {' '.join(inputs)!r} hold no text (the corpus is empty); check "
                        f"--field and the files")
    info = tokenizer_info(tok)
    store_tokenizer(tok, out)
    chunks = [(work / f"chunk-{k:06d}.bin", stats[k][0]) for k in sorted(stats)]
    meta = write_shards_from_files(out, chunks, info, val_fraction, shard_tokens)
    shutil.rmtree(work, ignore_errors=True)
    return meta


def wrote(meta: dict) -> str:
    """What a prepared directory holds, for ``allhands prepare``'s last line."""
    n = {k: sum(e["tokens"] for e in v) for k, v in meta["splits"].items()}
    if meta.get("kind") != "instruct":
        return f"{n['train']:,} train and {n['val']:,} val tokens"
    ex = {k: sum(e["examples"] for e in v) for k, v in meta["splits"].items()}
    return (f"{ex['train']:,} train and {ex['val']:,} val examples ({n['train'] + n['val']:,} "
            f"tokens, loss on the responses)")


def _pool(workers: int, spec: tuple):
    """The worker processes, started with TOKENIZERS_PARALLELISM=false (one thread each, and no
    fork warning from tokenizers); the caller's setting is restored after, so that its own
    tokenizers calls keep their threads."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        return ctx.Pool(workers, initializer=_init_worker, initargs=(spec,))
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _init_worker_here(spec: tuple) -> None:
    """Tokenize in this process (one worker): the tokenizer without the worker's signal set-up."""
    global _TOK
    _TOK = load_tokenizer(*spec)
