"""Reading a local corpus as a stream of documents: text, JSON lines (plain, gzip, zstd),
parquet and Hugging Face ``save_to_disk`` directories, named by files, globs or directories.

Every reader yields ``(documents, bytes)`` batches, ``bytes`` being how far it advanced in the
file on disk, so the progress bar and its ETA count the input as stored. Nothing is fetched:
a ``datasets`` directory is read from its Arrow files with pyarrow (the same files
``datasets.load_from_disk`` maps), so the heavy ``datasets`` package is not needed here.
"""

from __future__ import annotations

import functools
import glob
import gzip
import io
import json
import operator
from pathlib import Path
from typing import Iterator

import numpy as np

from allhands.errors import DataError

TEXT = (".txt", ".text", ".md")
JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
PARQUET = (".parquet",)
ARROW = (".arrow",)
KNOWN = TEXT + JSONL + PARQUET + ARROW
BATCH_DOCS = 1024  # documents per yielded batch: amortises the per-batch bookkeeping

Batches = Iterator[tuple[list[str], int]]


def _kind(p: Path) -> str | None:
    name = p.name.lower()
    for kind, exts in (("text", TEXT), ("jsonl", JSONL), ("parquet", PARQUET), ("arrow", ARROW)):
        if name.endswith(exts):
            return kind
    return None


def _saved_dataset_files(d: Path) -> list[Path] | None:
    """The Arrow files of a ``datasets.Dataset.save_to_disk`` directory, in their order
    (``state.json`` lists them), or None when ``d`` is not one."""
    state = d / "state.json"
    if not (state.is_file() and (d / "dataset_info.json").is_file()):
        return None
    files = json.loads(state.read_text()).get("_data_files", [])
    return [d / f["filename"] for f in files]


def expand_inputs(names: list[str]) -> list[Path]:
    """Files to read, in a fixed order: each name is a file, a glob or a directory (read
    recursively, sorted; a saved dataset inside counts as its Arrow files)."""
    out: list[Path] = []
    for name in names:
        matches = sorted(glob.glob(name, recursive=True)) if glob.has_magic(name) else [name]
        if not matches or not Path(matches[0]).exists():
            raise DataError(f"input {name!r} does not exist; pass files, globs or directories of "
                            f"{', '.join(KNOWN)} files or a datasets save_to_disk directory")
        for m in matches:
            p = Path(m)
            if p.is_dir():
                out.extend(_walk(p))
            elif _kind(p) is None:
                raise DataError(f"input {m!r} has an unknown extension; allowed: {', '.join(KNOWN)}")
            else:
                out.append(p)
    if not out:
        raise DataError(f"inputs {' '.join(names)!r} hold no {', '.join(KNOWN)} file; the corpus "
                        f"is empty")
    return out


def _walk(d: Path) -> list[Path]:
    saved = _saved_dataset_files(d)
    if saved is not None:
        return saved
    out = []
    for child in sorted(d.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            out.extend(_walk(child))
        elif _kind(child) is not None:
            out.append(child)
    return out


def read_documents(path: Path, field: str = "text") -> Batches:
    """Batches of ``path``'s documents: a text file is one document; a JSON line, a parquet or
    Arrow row is one, its ``field`` (a string)."""
    kind = _kind(path)
    if kind == "text":
        yield from _text(path)
    elif kind == "jsonl":
        yield from _jsonl(path, field)
    elif kind == "parquet":
        yield from _parquet(path, field)
    else:
        yield from _arrow(path, field)


def _text(path: Path) -> Batches:
    raw = path.read_bytes()
    try:
        yield [raw.decode("utf-8")], len(raw)
    except UnicodeDecodeError as e:
        raise DataError(f"text file {str(path)!r} is not UTF-8 ({e.reason} at byte {e.start}); "
                        f"convert it, e.g. with iconv") from None


class _Counting(io.RawIOBase):
    """A file whose read position on disk is known even under a decompressor."""

    def __init__(self, f):
        self.f, self.pos = f, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.pos += n
        return n


def _open_jsonl(path: Path, raw: _Counting):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if name.endswith(".zst"):
        try:
            import zstandard  # optional dependency: the `data` extra
        except ImportError:
            raise DataError(f"{str(path)!r} is zstd-compressed; install the data extra: "
                            f"pip install 'allhands[data]'") from None
        return zstandard.ZstdDecompressor().stream_reader(raw)
    return raw


def _jsonl(path: Path, field: str) -> Batches:
    for data, line, advanced in jsonl_blocks(path, 1 << 22):
        docs = jsonl_docs(path, data, field, line)
        for i in range(0, max(len(docs), 1), BATCH_DOCS):
            yield docs[i:i + BATCH_DOCS], advanced if i == 0 else 0


def jsonl_blocks(path: Path, size: int) -> Iterator[tuple[bytes, int, int]]:
    """A (compressed) JSON-lines file as blocks of whole lines of about ``size`` bytes:
    ``(block, number of its first line, bytes advanced on disk)``."""
    with open(path, "rb", buffering=0) as f:
        raw = _Counting(f)
        stream = _open_jsonl(path, raw)
        rest, line, last = b"", 1, 0
        try:
            while got := stream.read(size):
                data = rest + got
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # no line ends yet: read on
                    rest = data
                    continue
                block, rest = data[:cut], data[cut:]
                yield block, line, raw.pos - last
                line, last = line + block.count(b"\n"), raw.pos
        except (OSError, EOFError) as e:  # a damaged gzip or zstd stream
            raise DataError(f"{str(path)!r} cannot be decompressed ({e}); the file is damaged") from None
        if rest or raw.pos > last:
            yield rest, line, raw.pos - last


def is_jsonl(path: Path) -> bool:
    return _kind(path) == "jsonl"


def is_plain_jsonl(path: Path) -> bool:
    return path.name.lower().endswith((".jsonl", ".ndjson"))


def jsonl_ranges(path: Path, size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` byte ranges of whole lines of an uncompressed JSON-lines file, each
    about ``size`` bytes: only the bytes around each cut are read."""
    total = path.stat().st_size
    with open(path, "rb") as f:
        start = 0
        while start < total:
            end = min(start + size, total)
            f.seek(end - 1)  # the range ends after the first line end at or after end - 1
            while end < total:
                piece = f.read(1 << 16)
                i = piece.find(b"\n")
                if i >= 0:
                    end += i
                    break
                end += len(piece)
            end = min(end, total)
            yield start, end
            start = end


def read_range(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


_TEXT = operator.attrgetter("text")


@functools.lru_cache(maxsize=8)
def _msgspec_decoder(field: str):
    import msgspec  # optional dependency: the `data` extra (see _fast_docs)

    # gc=False: the documents' structs hold only a string, so the collector need not track them
    doc = msgspec.defstruct("Doc", [("text", str)], rename={"text": field}, gc=False)
    return msgspec.json.Decoder(doc)


def _fast_docs(data: bytes, field: str) -> list[str] | None:
    """``data``'s documents decoded by msgspec (several times faster than the json module), or
    None where that might not give json's result; json then reads the block, and gives the same
    documents or the exact error. msgspec reads a stream of values, whatever the line breaks;
    here each line starts with ``{`` and ends with ``}``, so no value can go on past a line's
    end (a string holds no raw line break, and ``}`` then ``{`` is JSON only between two
    values), and as many values as lines means one value per line."""
    try:
        import msgspec  # optional dependency: the `data` extra
    except ImportError:
        return None
    raw = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(raw == 0x0A)  # line ends
    last = data.endswith(b"\n")
    if not (data.startswith(b"{") and data.endswith(b"}\n" if last else b"}")
            and np.all(raw[ends - 1] == 0x7D) and np.all(raw[ends[:len(ends) - last] + 1] == 0x7B)):
        return None
    try:
        docs = _msgspec_decoder(field).decode_lines(data)
    except (ValueError, msgspec.MsgspecError):
        return None
    return list(map(_TEXT, docs)) if len(docs) == len(ends) + (not last) else None


def jsonl_docs(path: Path, data: bytes, field: str, first_line: int = 0, start: int = 0) -> list[str]:
    """The documents of ``data``, whole JSON lines of ``path``; blank lines are skipped. The
    first line's number (for errors), when not given, is counted from ``start``, its offset."""
    docs = _fast_docs(data, field)
    if docs is not None:
        return docs
    if not first_line:
        first_line = 1 + read_range(path, 0, start).count(b"\n")
    return [_json_field(path, first_line + i, line, field)
            for i, line in enumerate(data.split(b"\n")) if line.strip()]


def _json_field(path: Path, lineno: int, line: bytes, field: str) -> str:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{str(path)!r} line {lineno} is not JSON ({e}); each line must be one "
                        f"JSON object") from None
    if not isinstance(obj, dict) or field not in obj:
        keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{str(path)!r} line {lineno} has no field {field!r} (it has: {keys}); "
                        f"pass --field NAME")
    value = obj[field]
    if not isinstance(value, str):
        raise DataError(f"{str(path)!r} line {lineno}: field {field!r} is a "
                        f"{type(value).__name__}, not text; pass --field of a text field")
    return value


def _check_column(path: Path, schema, column: str) -> None:
    import pyarrow as pa  # optional dependency: the `data` extra

    if column not in schema.names:
        raise DataError(f"{str(path)!r} has no column {column!r} (it has: "
                        f"{', '.join(schema.names)}); pass --field NAME")
    t = schema.field(column).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        raise DataError(f"{str(path)!r}: column {column!r} holds {t}, not text; pass --field "
                        f"of a string column")


def _column_texts(path: Path, batch, column: str) -> list[str]:
    texts = batch.column(column).to_pylist()
    if any(t is None for t in texts):
        raise DataError(f"{str(path)!r}: column {column!r} has null rows; drop them or fill them")
    return texts


def _pyarrow():
    try:
        import pyarrow  # optional dependency: the `data` extra
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError("reading parquet or Arrow needs pyarrow; install the data extra: "
                        "pip install 'allhands[data]'") from None
    return pyarrow


def _parquet(path: Path, column: str) -> Batches:
    pa = _pyarrow()
    try:
        pf = pa.parquet.ParquetFile(path)
    except pa.ArrowException as e:
        raise DataError(f"{str(path)!r} is not a parquet file ({e})") from None
    _check_column(path, pf.schema_arrow, column)
    size, rows = path.stat().st_size, max(pf.metadata.num_rows, 1)
    done = 0
    for batch in pf.iter_batches(batch_size=BATCH_DOCS, columns=[column]):
        # parquet is read by row group, so progress is the share of rows times the file size
        before = done * size // rows
        done += batch.num_rows
        yield _column_texts(path, batch, column), done * size // rows - before


def _arrow(path: Path, column: str) -> Batches:
    pa = _pyarrow()
    try:  # datasets writes the IPC stream format; other tools write the file format
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path)))
        except pa.ArrowInvalid as e:
            raise DataError(f"{str(path)!r} is not an Arrow file ({e})") from None
    _check_column(path, reader.schema, column)
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
        if hasattr(reader, "num_record_batches") else reader
    size, done = path.stat().st_size, 0
    for rb in batches:
        texts = _column_texts(path, rb, column)
        step = min(rb.nbytes, size - done)  # a batch's share of the file, approximately
        done += step
        for i in range(0, len(texts), BATCH_DOCS):
            yield texts[i:i + BATCH_DOCS], step if i == 0 else 0
    yield [], size - done
