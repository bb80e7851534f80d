"""Tokenizers that turn a batch of documents into one id stream with an end-of-document token
after each: bytes (no vocabulary file, lossless on any text), a Hugging Face ``tokenizer.json``
(the ``tokenizers`` library) alone or in a transformers tokenizer directory (with its
``tokenizer_config.json``: end-of-document and beginning-of-document tokens, chat template), or a
byte-level BPE trained on the corpus itself.

The ``tokenizers`` library is an optional dependency (the ``data`` extra), imported where used.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Iterable

import numpy as np

from allhands.errors import DataError

EOT = "<|endoftext|>"
# Tried in order when a tokenizer.json does not say which token ends a document (GPT-2,
# Llama/Mistral, Llama 3, generic).
EOT_CANDIDATES = (EOT, "</s>", "<|end_of_text|>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# transformers >= 4.43 saves the chat template in a file of its own beside the config
CHAT_TEMPLATE_FILE = "chat_template.jinja"


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
    eot_token = EOT  # its text: the exported tokenizer.json's special token (byte_tokenizer_json)
    vocab_size = 257
    dtype = np.uint16
    prefix: list[int] = []  # no beginning-of-document token
    config: dict = {}
    dir = None

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

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, start, end): each id with the characters of ``text`` it came from; the text
        ``<|endoftext|>`` is the EOT id, as in the tokenizer.json that export writes."""
        ids, starts, ends, at = [], [], [], 0
        for k, part in enumerate(text.split(EOT)):
            if k:
                ids.append(np.array([self.eot]))
                starts.append(np.array([at]))
                ends.append(np.array([at + len(EOT)]))
                at += len(EOT)
            try:
                raw = part.encode()
            except UnicodeEncodeError as e:
                raise _not_text(e) from None
            width = np.fromiter((len(c.encode()) for c in part), np.int64, len(part))
            pos = np.repeat(np.arange(at, at + len(part)), width)  # the character of each byte
            ids.append(np.frombuffer(raw, np.uint8).astype(np.int64))
            starts.append(pos)
            ends.append(pos + 1)
            at += len(part)
        return np.concatenate(ids), np.concatenate(starts), np.concatenate(ends)

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


def token_text(value) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer config {str(path)!r} is not valid JSON ({e}); fix it or "
                        f"remove it") from None
    if not isinstance(config, dict):
        raise DataError(f"tokenizer config {str(path)!r} is not a JSON object; fix it or remove it")
    return config


class HFTokenizer:
    """A ``tokenizer.json`` of the tokenizers library, or a transformers tokenizer directory
    holding one. ``eot`` names the end-of-document token (default: the directory's
    ``eos_token``, else the first of EOT_CANDIDATES in the vocabulary). Each document starts
    with the beginning-of-document ids transformers' ``tokenizer(text)`` puts first: the
    config's ``bos_token`` where it says ``add_bos_token``, else what tokenizer.json's
    post-processor adds in front (Llama 3's ``<|begin_of_text|>``; none for GPT-2 or Qwen)."""

    name = "hf"

    def __init__(self, path: str | Path, eot: str = ""):
        tk = _library()
        given = Path(path)
        self.dir = given if given.is_dir() else None
        self.path = given / TOKENIZER_FILE if self.dir else given
        if not self.path.is_file():
            what = f"tokenizer directory {str(path)!r} has no {TOKENIZER_FILE}" if self.dir else \
                f"tokenizer {str(path)!r} does not exist"
            raise DataError(f"{what}; pass a tokenizer.json file, a directory holding one (a "
                            f"transformers fast tokenizer's save_pretrained), 'byte', or "
                            f"--train-tokenizer bpe:VOCAB")
        try:
            self.tok = tk.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise DataError(f"tokenizer {str(self.path)!r} does not parse ({str(e)[:120]}); pass "
                            f"a tokenizer.json saved by the tokenizers library") from None
        config_file = self.dir / TOKENIZER_CONFIG if self.dir else None
        self.config = _read_config(config_file) if config_file and config_file.is_file() else {}
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.dtype = dtype_for(self.vocab_size)
        eos = token_text(self.config.get("eos_token"))
        names = (eot,) if eot else (eos,) if eos else EOT_CANDIDATES
        ids = [(n, self.tok.token_to_id(n)) for n in names]
        found = [(n, i) for n, i in ids if i is not None]
        if not found:
            raise DataError(f"tokenizer {str(path)!r} has no end-of-document token "
                            f"{' or '.join(names)}; pass --eot TOKEN naming one of its tokens")
        self.eot_token, self.eot = found[0]
        self.prefix = self._prefix(str(path))

    def _prefix(self, where: str) -> list[int]:
        if "add_bos_token" not in self.config:
            probe = self.tok.encode("a", add_special_tokens=True)
            lead = 0
            while lead < len(probe.ids) and probe.special_tokens_mask[lead]:
                lead += 1
            return list(probe.ids[:lead])
        if not self.config["add_bos_token"]:
            return []
        bos = token_text(self.config.get("bos_token"))
        if self.tok.token_to_id(bos) is None:
            raise DataError(f"tokenizer {where!r}: {TOKENIZER_CONFIG} says add_bos_token but its "
                            f"bos_token {bos!r} is not in the vocabulary; fix the config")
        return [self.tok.token_to_id(bos)]

    def chat_template(self) -> str | None:
        """The directory's chat template (chat_template.jinja, or the config's chat_template,
        a string or a list of named ones of which ``default``), or None."""
        if self.dir and (self.dir / CHAT_TEMPLATE_FILE).is_file():
            return (self.dir / CHAT_TEMPLATE_FILE).read_text()
        t = self.config.get("chat_template")
        if isinstance(t, list):
            t = next((e.get("template") for e in t if isinstance(e, dict) and e.get("name") == "default"), None)
        return t if isinstance(t, str) else None

    def special_tokens(self) -> dict[str, str]:
        """The special tokens a chat template refers to by name, as text."""
        out = {k: token_text(self.config.get(k)) for k in ("bos_token", "unk_token", "pad_token")}
        return {**out, "eos_token": self.eot_token}

    def files(self) -> list[Path]:
        """What is stored beside the shards, so training and export use this same tokenizer."""
        extra = [self.dir / n for n in (TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE, "special_tokens_map.json")] \
            if self.dir else []
        return [self.path, *(p for p in extra if p.is_file())]

    def encode_docs(self, texts: list[str]) -> np.ndarray:
        enc = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # fast: no offsets
        try:
            batch = enc(texts, add_special_tokens=False)
        except (TypeError, UnicodeEncodeError):  # the library cannot take a lone surrogate
            _check_text(texts)
            raise
        head = np.asarray(self.prefix, dtype=self.dtype)
        pieces = [np.concatenate([head, np.asarray(e.ids, dtype=self.dtype)]) if len(head) else
                  np.asarray(e.ids, dtype=self.dtype) for e in batch]
        return _join(pieces, self.eot, self.dtype)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, start, end): each id with the characters of ``text`` it came from; special
        tokens written in the text (a chat template's) are their ids, no others are added."""
        try:
            e = self.tok.encode(text, add_special_tokens=False)
        except (TypeError, UnicodeEncodeError):
            _check_text([text])
            raise
        span = np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(e.ids, dtype=np.int64), span[:, 0], span[:, 1]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _check_text(texts: list[str]) -> None:
    for t in texts:
        try:
            t.encode()
        except UnicodeEncodeError as bad:
            raise _not_text(bad) from None


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

    tok = tk.Tokenizer(models.BPE(vocab=byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok.to_str()


def byte_vocab() -> dict[str, int]:
    """The byte tokenizer's token -> id map, spelled as its tokenizer.json spells it."""
    return {**{ch: b for b, ch in gpt2_bytes_to_unicode().items()}, EOT: ByteTokenizer.eot}


def vocab_of(path: Path) -> dict[str, int] | None:
    """The token -> id map a tokenizer.json defines: its model's vocabulary (a dict for BPE,
    WordPiece and WordLevel; a list of ``[piece, score]`` for Unigram, the id being the position)
    and its added tokens. None when the file is missing or not a tokenizer.json we can read. Plain
    JSON: no tokenizers library needed."""
    try:
        j = json.loads(Path(path).read_text(encoding="utf-8"))
        vocab = j["model"]["vocab"]
        out = ({str(k): int(v) for k, v in vocab.items()} if isinstance(vocab, dict)
               else {str(piece[0]): i for i, piece in enumerate(vocab)})
        out.update({str(t["content"]): int(t["id"]) for t in j.get("added_tokens") or ()})
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    return out


def prepared_vocab(path: Path, meta: dict) -> dict[str, int] | None:
    """The token -> id map of the tokenizer a prepared directory (with its ``meta``) was made
    with: the byte tokenizer's, or that of the tokenizer.json stored beside the shards."""
    if meta.get("tokenizer") == "byte":
        return byte_vocab()
    return vocab_of(Path(path) / meta.get("tokenizer_file", TOKENIZER_FILE))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tokenizer_info(tok) -> dict:
    """What meta.json records of a tokenizer, and what makes two prepared directories
    mixable: the same ids for the same text."""
    if isinstance(tok, ByteTokenizer):
        return {"tokenizer": "byte", "vocab_size": tok.vocab_size, "eot": tok.eot,
                "tokenizer_id": "byte"}
    # the beginning-of-document ids change the stream as much as the vocabulary does
    bos = f":bos={','.join(map(str, tok.prefix))}" if tok.prefix else ""
    return {"tokenizer": "hf", "vocab_size": tok.vocab_size, "eot": tok.eot,
            "eot_token": tok.eot_token, "tokenizer_file": TOKENIZER_FILE,
            **({"bos": tok.prefix} if tok.prefix else {}),
            "tokenizer_id": file_sha256(tok.path) + bos}


def store_tokenizer(tok, out: Path) -> None:
    """The tokenizer's files beside the shards: tokenizer.json (whatever its name was) and a
    directory's config and chat template, so that the prepared directory is itself a tokenizer
    directory (``--tokenizer DIR`` again gives the same ids)."""
    if isinstance(tok, ByteTokenizer):
        return
    for f in tok.files():
        shutil.copyfile(f, out / (TOKENIZER_FILE if f == tok.path else f.name))


def load_tokenizer(spec: str, eot: str = ""):
    """``byte``, the path of a tokenizer.json, or a directory holding one."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec, eot)

