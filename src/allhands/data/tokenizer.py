"""Byte-level tokenizer: every UTF-8 byte is a token, plus one end-of-text token.

No vocabulary file, no download, lossless on any text.
"""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    name = "byte"
    eot = 256
    vocab_size = 257
    dtype = np.uint16

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(self.dtype)

    def decode(self, ids) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        return bytes(int(i) for i in arr if 0 <= i < 256).decode("utf-8", errors="replace")
