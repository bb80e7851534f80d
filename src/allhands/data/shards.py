"""Token shards on disk: ``DIR/meta.json`` plus raw ``uint16``/``uint32`` files read by memmap.

Layout written by :func:`prepare`::

    DIR/meta.json            {"format": 1, "tokenizer": "byte", "vocab_size": 257, "dtype": "uint16",
                              "splits": {"train": [{"file": "train-000.bin", "tokens": N}, ...],
                                         "val": [...]}}
    DIR/train-000.bin ...    concatenated token ids, documents separated by the end-of-text token

A sample is a window of ``seq_len + 1`` tokens starting at a multiple of ``seq_len`` inside one
shard: ``x = window[:-1]``, ``y = window[1:]``.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from allhands.data.examples import example_splits
from allhands.data.packing import PackedDataset
from allhands.data.tokenizer import ByteTokenizer, dtype_for, tokenizer_info
from allhands.errors import DataError, cannot_write

FORMAT = 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Each split must hold one sample of the default model.seq_len (128) plus its target token, or
# training on it fails in its workers; smaller inputs are refused here, when it is cheap to say.
MIN_SPLIT_TOKENS = 129


def write_shards(out: Path, pieces: Iterable[np.ndarray], total: int, info: dict,
                 val_fraction: float = 0.05, shard_tokens: int = 1 << 24) -> dict:
    """Write the token stream given as ``pieces`` (``total`` tokens in all) as train/val shards
    and meta.json (with the tokenizer ``info``) into ``out``; the last ``val_fraction`` of the
    stream is the val split. Streams: no more than one piece is held at a time."""
    dtype = dtype_for(info["vocab_size"])
    it, held = iter(pieces), [np.zeros(0, dtype)]

    def fill(f, n: int) -> None:
        while n:
            if not len(held[0]):
                held[0] = np.ascontiguousarray(next(it), dtype=dtype)
                continue
            take = min(len(held[0]), n)
            f.write(held[0][:take].data)  # one write call (see corpus._encode_chunk)
            held[0], n = held[0][take:], n - take

    return _write(out, total, info, val_fraction, shard_tokens, fill)


def write_shards_from_files(out: Path, files: list[tuple[Path, int]], info: dict,
                            val_fraction: float = 0.05, shard_tokens: int = 1 << 24) -> dict:
    """:func:`write_shards` of the stream stored as raw token ``files`` (path, tokens), in
    order; the bytes are copied file to file by the kernel (copy_file_range), never through
    Python, or read and written where the system has no such call."""
    itemsize = np.dtype(dtype_for(info["vocab_size"])).itemsize
    queue = [(path, n * itemsize) for path, n in reversed(files)]
    src: list = [None, 0, 0]  # the open source file, its offset, the bytes left in it

    def fill(f, n: int) -> None:
        f.flush()
        n *= itemsize
        while n:
            if not src[2]:
                if src[0] is not None:
                    src[0].close()
                path, size = queue.pop()
                src[:] = [open(path, "rb"), 0, size]
                continue
            step = min(n, src[2])
            try:
                done = os.copy_file_range(src[0].fileno(), f.fileno(), step, src[1])
            except (AttributeError, OSError):  # not Linux, or not between these file systems
                done = f.write(os.pread(src[0].fileno(), min(step, 1 << 24), src[1]))
                f.flush()
            if done <= 0:
                raise DataError(f"{src[0].name!r} ended early; re-run `allhands prepare`")
            src[1], src[2], n = src[1] + done, src[2] - done, n - done

    try:
        return _write(out, sum(n for _, n in files), info, val_fraction, shard_tokens, fill)
    finally:
        if src[0] is not None:
            src[0].close()


def _write(out: Path, total: int, info: dict, val_fraction: float, shard_tokens: int,
           fill) -> dict:
    """The shard layout: ``fill(file, n)`` writes the stream's next ``n`` tokens to ``file``."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction {val_fraction} must be in (0, 1)")
    # Each split holds at least one sample of the default model.seq_len plus its target.
    n_val = max(MIN_SPLIT_TOKENS, int(total * val_fraction))
    if total - n_val < MIN_SPLIT_TOKENS:
        raise DataError(f"prepare: the input is {total} tokens; it needs {n_val + MIN_SPLIT_TOKENS} "
                        f"or more (one sample of the default model.seq_len+1={MIN_SPLIT_TOKENS} "
                        f"tokens in each split); pass more text")
    dtype = dtype_for(info["vocab_size"])
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out: {cannot_write(out, e)}; pass a writable directory") from None
    splits: dict[str, list[dict]] = {}
    for split, left in (("train", total - n_val), ("val", n_val)):
        entries = splits[split] = []
        while True:  # one shard file per turn; an empty split still gets one (empty) file
            name, n = f"{split}-{len(entries):03d}.bin", min(shard_tokens, left)
            with open(out / name, "wb") as f:
                fill(f, n)
            left -= n
            entries.append({"file": name, "tokens": n})
            if left == 0:
                break
    meta = {"format": FORMAT, **info, "dtype": np.dtype(dtype).name, "splits": splits}
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / "meta.json")  # meta last: a directory with meta.json is complete
    return meta


def prepare(texts: list[str], out: str | os.PathLike, val_fraction: float = 0.05,
            shard_tokens: int = 1 << 24) -> dict:
    """Tokenize documents with the byte tokenizer and write train/val shards to ``out``.

    The last ``val_fraction`` of the token stream is held out for evaluation.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction {val_fraction} must be in (0, 1)")
    tok = ByteTokenizer()
    if not any(t.strip() for t in texts):
        raise DataError("prepare: the input holds no text; pass files with text in them")
    stream = tok.encode_docs(texts)
    return write_shards(Path(out), [stream], len(stream), tokenizer_info(tok), val_fraction,
                        shard_tokens)


def embedded_text() -> str:
    """The corpus shipped with the package (see scripts/make_corpus.py)."""
    raw = resources.files("allhands.data").joinpath("corpus.txt.gz").read_bytes()
    return gzip.decompress(raw).decode("utf-8")


def prepare_embedded(out: str | os.PathLike) -> Path:
    """Shards of the embedded corpus, made once per directory."""
    out = Path(out)
    if not (out / "meta.json").is_file():
        # Made beside and renamed into place, so concurrent workers never read a half-written shard.
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        prepare(embedded_text().split("\n\n"), tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_files(files: list[tuple[Path, int]], dtype: np.dtype) -> None:
    for path, n_tokens in files:
        if not path.is_file():
            raise DataError(f"token shard {str(path)!r} is missing; re-run `allhands prepare`")
        size = path.stat().st_size
        if size != n_tokens * np.dtype(dtype).itemsize:
            raise DataError(f"token shard {str(path)!r} has {size} bytes, meta.json says "
                            f"{n_tokens} tokens; the data is truncated, re-run `allhands prepare`")


class TokenDataset(torch.utils.data.Dataset):
    """Map-style dataset of non-overlapping ``seq_len + 1`` windows over memmapped shards."""

    def __init__(self, files: list[tuple[Path, int]], dtype: np.dtype, seq_len: int):
        self.seq_len = seq_len
        self.maps = []
        self.offsets = [0]  # cumulative sample counts per shard
        _check_files(files, dtype)
        for path, n_tokens in files:
            n_samples = (n_tokens - 1) // seq_len if n_tokens > seq_len else 0
            if n_samples:
                self.maps.append(np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,)))
                self.offsets.append(self.offsets[-1] + n_samples)

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        shard = int(np.searchsorted(self.offsets, i, side="right")) - 1
        start = (i - self.offsets[shard]) * self.seq_len
        window = torch.from_numpy(self.maps[shard][start:start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


def load_meta(path: str | os.PathLike) -> dict:
    p = Path(path) / "meta.json"
    try:
        meta = json.loads(p.read_text())
    except FileNotFoundError:
        raise DataError(f"{str(p)!r} not found; make it with `allhands prepare TEXT_FILES --out "
                        f"{path}`") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{str(p)!r} is not valid JSON ({e}); re-run `allhands prepare`") from None
    if meta.get("format") != FORMAT or meta.get("dtype") not in DTYPES:
        raise DataError(f"{str(p)!r} has format {meta.get('format')!r} / dtype {meta.get('dtype')!r}; "
                        f"this allhands reads format {FORMAT} with uint16 or uint32")
    return meta


def load_token_splits(path: str | os.PathLike, seq_len: int,
                      packing: str = "concat") -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset, dict]:
    """(train, val, meta) datasets of a prepared directory: windows of the token stream
    (``concat``), rows of whole documents (``mask``, ``pad``: data/packing.py), or instruction
    examples (examples.ExampleDataset) where meta.json says ``"kind": "instruct"``."""
    meta = load_meta(path)
    dtype = DTYPES[meta["dtype"]]
    root = Path(path)
    if meta.get("kind") == "instruct":  # whole examples with a loss mask: examples.py
        train, val = example_splits(root, meta, dtype, seq_len)
        return train, val, meta
    splits = []
    for split in ("train", "val"):
        files = [(root / e["file"], int(e["tokens"])) for e in meta["splits"].get(split, [])]
        if packing == "concat":
            ds = TokenDataset(files, dtype, seq_len)
        else:
            _check_files(files, dtype)
            ds = PackedDataset(files, dtype, seq_len, int(meta["eot"]), packing)
        if len(ds) == 0:
            raise DataError(f"{split} split of {str(root)!r} holds no window of seq_len+1="
                            f"{seq_len + 1} tokens; give more text or a smaller model.seq_len")
        splits.append(ds)
    return splits[0], splits[1], meta
