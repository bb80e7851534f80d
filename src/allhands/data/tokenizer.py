"""Tokenizers that turn a batch of documents into one id stream with an end-of-document token
after each: bytes (no vocabulary file, lossless on any text), a Hugging Face ``tokenizer.json``
(the ``tokenizers`` library), or a byte-level BPE trained on the corpus itself.

The ``tokenizers`` library is an optional dependency (the ``data`` extra), imported where used.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

import numpy as np

from allhands.errors import DataError

EOT = "<|endoftext|>"
# Tried in order when a tokenizer.json does not say which token ends a document (GPT-2,
# Llama/Mistral, Llama 3, generic).
EOT_CANDIDATES = (EOT, "</s>", "<|end_of_text|>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"


def dtype_for(vocab_size: int) -> type:
    """The smallest unsigned shard dtype that holds every id."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _join(pieces: list[np.ndarray], eot: int, dtype) -> np.ndarray:
    """``pieces[0] eot pieces[1] eot ...``, built in one allocation."""
    lens = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    ends = np.cumsum(lens + 1) - 1
    out = np.empty(int(ends[-1]) + 1 if len(pieces) else 0, dtype=dtype)
    out[ends] = eot
    mask = np.ones(len(out), dtype=bool)
    mask[ends] = False
    if len(out):
        out[mask] = np.concatenate(pieces)
    return out


def _not_text(e: UnicodeEncodeError) -> DataError:
    """JSON may escape half of a UTF-16 pair (``\\udc80``); Python decodes it to a lone surrogate,
    which no UTF-8 tokenizer can take."""
    ch = e.object[e.start:e.end]
    return DataError(f"a document holds {ch!r}, a lone UTF-16 surrogate (e.g. a JSON {ascii(ch)[1:-1]} "
                     f"escape), which is not Unicode text; fix or drop that document")


class ByteTokenizer:
    name = "byte"
    eot = 256
    vocab_size = 257
    dtype = np.uint16

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(self.dtype)

    def encode_docs(self, texts: list[str]) -> np.ndarray:
        """One join and one widening, no per-document array; the byte after each document
        becomes EOT."""
        if not texts:
            return np.zeros(0, dtype=self.dtype)
        try:
            parts = list(map(str.encode, texts))  # UTF-8
        except UnicodeEncodeError as e:
            raise _not_text(e) from None
        ends = np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)) + 1) - 1
        parts.append(b"")
        ids = np.frombuffer(b"\0".join(parts), np.uint8).astype(self.dtype)
        ids[ends] = self.eot
        return ids

    def decode(self, ids) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        return bytes(int(i) for i in arr if 0 <= i < 256).decode("utf-8", errors="replace")


def _library():
    try:
        import tokenizers  # optional dependency: the `data` extra
    except ImportError:
        raise DataError("this tokenizer needs the tokenizers library; install the data extra: "
                        "pip install 'allhands[data]'") from None
    return tokenizers


class HFTokenizer:
    """A ``tokenizer.json`` of the tokenizers library; ``eot`` names the end-of-document token
    (default: the first of EOT_CANDIDATES in its vocabulary)."""

    name = "hf"

    def __init__(self, path: str | Path, eot: str = ""):
        tk = _library()
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"tokenizer {str(path)!r} does not exist; pass a tokenizer.json file, "
                            f"'byte', or --train-tokenizer bpe:VOCAB")
        try:
            self.tok = tk.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise DataError(f"tokenizer {str(path)!r} does not parse ({str(e)[:120]}); pass a "
                            f"tokenizer.json saved by the tokenizers library") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.dtype = dtype_for(self.vocab_size)
        names = (eot,) if eot else EOT_CANDIDATES
        ids = [(n, self.tok.token_to_id(n)) for n in names]
        found = [(n, i) for n, i in ids if i is not None]
        if not found:
            raise DataError(f"tokenizer {str(path)!r} has no end-of-document token "
                            f"{' or '.join(names)}; pass --eot TOKEN naming one of its tokens")
        self.eot_token, self.eot = found[0]

    def encode_docs(self, texts: list[str]) -> np.ndarray:
        enc = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # fast: no offsets
        try:
            batch = enc(texts, add_special_tokens=False)
        except (TypeError, UnicodeEncodeError):  # the library cannot take a lone surrogate
            for t in texts:
                try:
                    t.encode()
                except UnicodeEncodeError as bad:
                    raise _not_text(bad) from None
            raise
        pieces = [np.asarray(e.ids, dtype=self.dtype) for e in batch]
        return _join(pieces, self.eot, self.dtype)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def train_bpe(docs: Iterable[str], vocab_size: int, out: Path) -> Path:
    """Train GPT-2's byte-level BPE (Radford et al. 2019, sec. 2.2) on ``docs`` with
    ``vocab_size`` ids, EOT being id 0, and save its tokenizer.json to ``out``."""
    tk = _library()
    from tokenizers import decoders, models, pre_tokenizers, trainers  # optional, as above

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    try:
        tok.train_from_iterator(docs, trainer=trainer)
    except UnicodeEncodeError as e:
        raise _not_text(e) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (openai/gpt-2 src/encoder.py bytes_to_unicode),
    the alphabet of byte-level tokenizers."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def byte_tokenizer_json() -> str:
    """The byte tokenizer as a tokenizer.json (a byte-level BPE with no merges, ids = byte
    values, EOT = 256), so that a model trained on bytes leaves with a tokenizer transformers
    loads."""
    tk = _library()
    from tokenizers import decoders, models, pre_tokenizers  # optional, as above

    vocab = {ch: b for b, ch in gpt2_bytes_to_unicode().items()}
    vocab[EOT] = ByteTokenizer.eot
    tok = tk.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok.to_str()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tokenizer_info(tok) -> dict:
    """What meta.json records of a tokenizer, and what makes two prepared directories
    mixable: the same ids for the same text."""
    if isinstance(tok, ByteTokenizer):
        return {"tokenizer": "byte", "vocab_size": tok.vocab_size, "eot": tok.eot,
                "tokenizer_id": "byte"}
    return {"tokenizer": "hf", "vocab_size": tok.vocab_size, "eot": tok.eot,
            "eot_token": tok.eot_token, "tokenizer_file": TOKENIZER_FILE,
            "tokenizer_id": file_sha256(tok.path)}


def load_tokenizer(spec: str, eot: str = ""):
    """``byte`` or the path of a tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec, eot)

