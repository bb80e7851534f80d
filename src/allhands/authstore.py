"""A store whose every value carries a MAC under the job secret: what torch's rendezvous, the
agents and the process groups read from a TCPStore was written by a holder of the secret.

torch's TCPStore takes writes from anyone who reaches it (SECURITY.md). gloo learns where to
connect from it (``default_pg/...`` connection records), torch's c10d rendezvous keeps its state
there, and the agents their rank assignments: a forged record redirects the ranks to a relay or
restarts the job. :class:`MACStore` is a ``torch.distributed.Store`` in Python around the real
store: every value is stored as ``HMAC-SHA256(K, key, nonce, value) || nonce || value`` (``K``
derived from the job secret, a fresh 16-byte nonce per write), and every value read is checked
first; a value without a valid MAC is refused (:class:`IntrusionError`, logged once per key as an
intrusion). torch's own wrappers (``PrefixStore``) sit on top and are unaware of it.

- ``compare_set``: the stored bytes are read and checked, and swapped only if they still hold
  the expected value (TCPStore's compare-and-set on those exact bytes); an empty expected value
  means "absent", as in TCPStore.
- ``add`` (counters): the same compare-and-set loop on MAC'd decimal values, so a counter is as
  authenticated as any other value and still atomic. The nonce makes every write's bytes
  unique, so a swap that succeeded is told apart from one that met an equal value written by
  another process (a lost increment otherwise).
- Keys, their existence (``check``, ``wait``, ``num_keys``) and deletion are not authenticated:
  a stranger who reaches the store can delete or add keys, which stalls the job (denial of
  service) but never makes it read a forged value.
- A value can be replayed under the same key (the MAC binds key and value, not time): a stale
  but genuine record, e.g. an address of an earlier round, costs a failed connection, not a
  forged one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

from allhands.errors import LaunchError

_MAC = 32
_NONCE = 16
# torch's C++ side (PrefixStore, gloo) keeps only the C++ half of a Python store; once its Python
# half is collected, the C++ trampoline finds no methods ("Not implemented", torch's
# ``PythonStore`` in torch/csrc/distributed/c10d/init.cpp). So every MACStore lives as long as
# the process: a few per job.
_ALIVE: list["MACStore"] = []
_LABEL = b"allhands-store-v1"


class IntrusionError(LaunchError):
    """A store value without a valid MAC: written by a process that does not hold the job secret."""


def store_key(secret: str | bytes) -> bytes:
    """The MAC key for stores, derived from the job secret (kept apart from admission's use)."""
    raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    return hmac.new(raw, _LABEL, hashlib.sha256).digest()


def _bytes(value) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


class MACStore(dist.Store):
    """``inner`` (a TCPStore) with every value MAC'd under ``key`` (:func:`store_key`).
    ``where`` names the store in the intrusion line (e.g. "worker store at 10.0.0.1:4000")."""

    def __init__(self, inner: dist.Store, key: bytes, where: str = "the store"):
        super().__init__()
        self.inner, self._key, self.where = inner, key, where
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        _ALIVE.append(self)

    # -- the MAC
    def _tag(self, key: str, body: bytes) -> bytes:
        k = key.encode("utf-8")
        return hmac.new(self._key, len(k).to_bytes(4, "big") + k + body, hashlib.sha256).digest()

    def _seal(self, key: str, value) -> bytes:
        body = secrets.token_bytes(_NONCE) + _bytes(value)
        return self._tag(key, body) + body

    def _open(self, key: str, sealed) -> bytes:
        sealed = _bytes(sealed)
        body = sealed[_MAC:]
        if len(sealed) < _MAC + _NONCE or not hmac.compare_digest(sealed[:_MAC], self._tag(key, body)):
            self._intrusion(key)
        return body[_NONCE:]

    def _intrusion(self, key: str):
        msg = (f"intrusion: refused key {key!r} in the {self.where}: its value has no valid MAC "
               f"under the job secret, so a process outside the job wrote it (the store does "
               f"not say who; keep its address private, SECURITY.md)")
        with self._lock:
            first = key not in self._logged
            self._logged.add(key)
        if first:
            print(f"allhands: {msg}", file=sys.stderr, flush=True)
        raise IntrusionError(msg)

    # -- torch.distributed.Store
    def set(self, key: str, value) -> None:
        self.inner.set(key, self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self.inner.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._open(k, v) for k, v in zip(keys, self.inner.multi_get(keys))]

    def multi_set(self, keys: list[str], values: list) -> None:
        self.inner.multi_set(keys, [self._seal(k, v) for k, v in zip(keys, values)])

    def _raw(self, key: str) -> bytes:
        """The stored bytes of ``key`` (checked), or b"" when it is absent."""
        if not self.inner.check([key]):
            return b""
        raw = _bytes(self.inner.get(key))
        self._open(key, raw)
        return raw

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected = _bytes(expected)
        raw = self._raw(key)
        if expected and (not raw or self._open(key, raw) != expected):
            return self._open(key, raw) if raw else b""  # no swap, as TCPStore would answer
        if not expected and raw:
            return self._open(key, raw)
        return self._open(key, self.inner.compare_set(key, raw, self._seal(key, desired)))

    def _update(self, key: str, change) -> bytes:
        """Atomically replace the value of ``key`` by ``change(value)`` (b"" when absent)."""
        while True:
            raw = self._raw(key)
            new = change(self._open(key, raw) if raw else b"")
            sealed = self._seal(key, new)
            if _bytes(self.inner.compare_set(key, raw, sealed)) == sealed:
                return new
            # another process wrote first: retry from what is there now

    def add(self, key: str, amount: int) -> int:
        return int(self._update(key, lambda v: str((int(v) if v else 0) + amount).encode()))

    def append(self, key: str, value) -> None:
        self._update(key, lambda v: v + _bytes(value))

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout

    def has_extended_api(self) -> bool:
        return True

    def list_keys(self) -> list[str]:
        return self.inner.list_keys()

    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None:
        # A counter and a wait: the same as torch's own barrier, through the MAC'd add.
        self.add(key + "/arrived", 1)
        if self.add(key + "/arrived", 0) >= world_size:
            self.set(key + "/done", b"1")
        self.wait([key + "/done"], *([timeout] if timeout is not None else []))

    def clone(self) -> "MACStore":
        # gloo clones the store for its own threads: a clone of the connection, same key.
        twin = MACStore(self.inner.clone(), self._key, self.where)
        twin._logged, twin._lock = self._logged, self._lock
        return twin

    # torch's C++ trampoline looks these two up by their C++ names.
    getNumKeys = num_keys
    deleteKey = delete_key


def sealed(store: dist.Store, secret: str | None, where: str) -> dist.Store:
    """``store`` behind a :class:`MACStore` under ``secret``; as is without one (--insecure)."""
    return store if not secret else MACStore(store, store_key(secret), where)
