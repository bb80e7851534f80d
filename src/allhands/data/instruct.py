"""``allhands prepare`` of instruction data: JSON lines of prompt/response pairs or chat
conversations, to the example files of examples.py, with a loss mask on the responses.

A row is one of:

- ``{"prompt": P, "response": R}`` (``completion`` is taken for ``response``, as TRL names it):
  completion-style text, no template (the prompt carries its own formatting): the
  beginning-of-document ids, the ids of ``P + R``, the end-of-document id. The loss is on the ids
  of ``R`` and on the end-of-document id.
- ``{"messages": [{"role": ..., "content": ...}, ...]}``, roles ``system``, ``user``,
  ``assistant``, ``tool``, with at least one assistant message: rendered by the chat template
  (chat.py) and tokenized whole; the loss is on every assistant message's ids.

An id carries loss when its characters overlap a response's (an id that straddles the prompt's
end and the response's start is one the model must produce). The last ``val_fraction`` of the
examples (at least one) is the val split.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from allhands.data.chat import ROLES, ChatRenderer
from allhands.data.examples import INDEX, MASK, TOKENS
from allhands.data.formats import expand_inputs, is_jsonl, jsonl_blocks
from allhands.data.shards import FORMAT
from allhands.data.tokenizer import (ByteTokenizer, dtype_for, load_tokenizer, store_tokenizer,
                                     token_text, tokenizer_info)
from allhands.errors import DataError, cannot_write

RESPONSE_FIELDS = ("response", "completion")


def _rows(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of each non-blank line of a (compressed) JSON-lines file."""
    for data, first, _ in jsonl_blocks(path, 1 << 22):
        for i, line in enumerate(data.split(b"\n")):
            if line.strip():
                yield first + i, line


def looks_instruct(inputs: list[str]) -> bool:
    """Whether the first row of the first input is instruction data (``messages`` or
    ``prompt``): ``--format auto``'s rule."""
    files = expand_inputs(inputs)
    if not is_jsonl(files[0]):
        return False
    for _, line in _rows(files[0]):
        try:
            row = json.loads(line)
        except ValueError:
            return False  # the text reader words the error
        return isinstance(row, dict) and ("messages" in row or "prompt" in row)
    return False


def _parse(path: Path, lineno: int, line: bytes) -> dict:
    where = f"{str(path)!r} line {lineno}"
    try:
        row = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where} is not JSON ({e}); each line must be one JSON object") from None
    if not isinstance(row, dict):
        raise DataError(f"{where} is a JSON {type(row).__name__}, not an object with messages or "
                        f"prompt/response")
    if "messages" in row:
        return {"messages": _messages(where, row["messages"])}
    response = next((f for f in RESPONSE_FIELDS if f in row), None)
    if "prompt" not in row or response is None:
        raise DataError(f"{where} has no messages or prompt and response fields (it has: "
                        f"{', '.join(map(str, row)) or 'none'}); each row needs messages, or "
                        f"prompt and response")
    for f in ("prompt", response):
        if not isinstance(row[f], str):
            raise DataError(f"{where}: field {f!r} is a {type(row[f]).__name__}, not text")
    return {"prompt": row["prompt"], "response": row[response]}


def _messages(where: str, messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {k} must be an object with role and content")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {k} has role {m['role']!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {k}'s content is a {type(m['content']).__name__}, "
                            f"not text")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message, so nothing to train on; add the response "
                        f"as a message with role assistant")
    return out


def _overlap(starts: np.ndarray, ends: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    keep = np.zeros(len(starts), dtype=bool)
    for s, e in spans:
        keep |= (starts < e) & (ends > s)
    return keep


def encode_example(tok, chat: ChatRenderer | None, row: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one parsed row: the ids and whether each is a target with loss."""
    if "messages" in row:
        text, spans = chat.render(row["messages"], where)
        ids, starts, ends = tok.encode_offsets(text)
        keep = _overlap(starts, ends, spans)
        head = tok.prefix if chat.is_default else []  # a model's own template writes its BOS
        tail_ids, tail_keep = [], []
    else:
        text = row["prompt"] + row["response"]
        ids, starts, ends = tok.encode_offsets(text)
        keep = _overlap(starts, ends, [(len(row["prompt"]), len(text))])
        head, tail_ids, tail_keep = tok.prefix, [tok.eot], [True]
    ids = np.concatenate([np.asarray(head, np.int64), ids, np.asarray(tail_ids, np.int64)])
    keep = np.concatenate([np.zeros(len(head), bool), keep, np.asarray(tail_keep, bool)])
    return ids, keep.astype(np.uint8)


def _pad_id(tok) -> int:
    pad = token_text(tok.config.get("pad_token"))
    found = tok.tok.token_to_id(pad) if pad else None  # the byte tokenizer has no config
    return tok.eot if found is None else found


def prepare_instruct(inputs: list[str], out: Path, *, tokenizer: str = "byte", eot: str = "",
                     val_fraction: float = 0.05) -> dict:
    """Tokenize the instruction rows of ``inputs`` into ``out``; returns meta.json's content."""
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction: {val_fraction} is not allowed; must be in (0, 1)")
    files = expand_inputs(inputs)
    for f in files:
        if not is_jsonl(f):
            raise DataError(f"input {str(f)!r}: instruction data is JSON lines (.jsonl, .jsonl.gz, "
                            f".jsonl.zst) with messages or prompt/response per row")
    tok = load_tokenizer(tokenizer, eot)
    chat = None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out: {cannot_write(out, e)}; pass a writable directory") from None
    info = tokenizer_info(tok)
    dtype = dtype_for(info["vocab_size"])
    index, n_tokens = [0], 0
    with open(out / TOKENS, "wb") as ft, open(out / MASK, "wb") as fm:
        for path in files:
            for lineno, line in _rows(path):
                row = _parse(path, lineno, line)
                if "messages" in row and chat is None:
                    template = None if isinstance(tok, ByteTokenizer) else tok.chat_template()
                    special = {"eos_token": tok.eot_token} if isinstance(tok, ByteTokenizer) \
                        else tok.special_tokens()
                    chat = ChatRenderer(template, special)
                ids, keep = encode_example(tok, chat, row, f"{str(path)!r} line {lineno}")
                ft.write(ids.astype(dtype).data)
                fm.write(keep.data)
                n_tokens += len(ids)
                index.append(n_tokens)
    n = len(index) - 1
    n_val = max(1, int(n * val_fraction))
    if n - n_val < 1:
        raise DataError(f"inputs {' '.join(inputs)!r} hold {n} example(s); instruction data needs "
                        f"2 or more (one in each of the train and val splits)")
    np.asarray(index, dtype=np.int64).tofile(out / INDEX)
    splits = {}
    for split, first, count in (("train", 0, n - n_val), ("val", n - n_val, n_val)):
        splits[split] = [{"file": TOKENS, "mask": MASK, "index": INDEX, "first": first,
                          "examples": count, "tokens": index[first + count] - index[first]}]
    store_tokenizer(tok, out)
    meta = {"format": FORMAT, "kind": "instruct", **info, "dtype": np.dtype(dtype).name,
            "examples": n, "pad": _pad_id(tok),
            "chat_template": "default" if chat is not None and chat.is_default else
            "tokenizer" if chat is not None else "none", "splits": splits}
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / "meta.json")  # meta last: a directory with meta.json is complete
    return meta
