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
- A value can be replayed under the same key within one incarnation of the store (the MAC binds
  key, value and the ``context`` the store was made with, not time): a stale but genuine record,
  e.g. an address of an earlier round, costs a failed connection, not a forged one. A store made
  per job run with a fresh ``context`` (or secret) refuses every value of an earlier run.

``tolerant=True`` (the replica groups' quorum store and the parameter server's link store, whose
decisions are taken on keys that outlive any one process): a value without a valid MAC is
*absent*, not fatal. It is logged once per key as an intrusion and ignored: ``check`` is an
authenticated read (existence alone decides nothing), ``get``/``wait`` wait for a genuine value,
``compare_set``/``add`` swap over the forged bytes as over an absent key. Genuine state a
stranger overwrote is put back: every process remembers the last genuine bytes it wrote or read
of each key and writes them back over forged ones (compare-and-set on the forged bytes, so a
genuine write is never undone), on every read and, for the keys it wrote, from a keeper thread
every ``KEEP_S``. A genuine value never seen by any live process cannot be re-derived: its
reader waits for it up to the store's timeout, then fails naming the key (IntrusionError).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sys
import threading
import time
from collections import OrderedDict
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
# What TCPStore's compare_set(key, PROBE, PROBE) answers: PROBE when the key is absent (nothing
# is written), else the stored bytes. One round trip that never blocks, unlike check-then-get,
# which waits up to the timeout when the key is deleted in between.
_PROBE = b"\x00allhands-probe"
_MEMO = 4096  # genuine values remembered per process (tolerant stores), most recent first
KEEP_S = 0.25  # how often a tolerant store's keeper puts back the keys it wrote, if forged


class IntrusionError(LaunchError):
    """A store value without a valid MAC: written by a process that does not hold the job secret."""


def store_key(secret: str | bytes, context: str | bytes = b"") -> bytes:
    """The MAC key for stores, derived from the job secret (kept apart from admission's use) and
    the store's ``context`` (the job run's incarnation, where one store outlives a run)."""
    raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    return hmac.new(raw, _LABEL + _bytes(context), hashlib.sha256).digest()


def _bytes(value) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


class _Memory:
    """A tolerant store's memory, shared by its clones: the last genuine bytes per key, the keys
    this process wrote (the keeper's), and the keys already logged."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen: OrderedDict[str, bytes] = OrderedDict()
        self.mine: OrderedDict[str, None] = OrderedDict()
        self.logged: set[str] = set()
        self.keeper: threading.Thread | None = None
        self.closed = threading.Event()

    def remember(self, key: str, raw: bytes, mine: bool = False) -> None:
        with self.lock:
            self.seen[key] = raw
            self.seen.move_to_end(key)
            if mine:
                self.mine[key] = None
                self.mine.move_to_end(key)
            for d in (self.seen, self.mine):
                while len(d) > _MEMO:
                    d.popitem(last=False)

    def forget(self, key: str) -> None:
        with self.lock:
            self.seen.pop(key, None)
            self.mine.pop(key, None)


class MACStore(dist.Store):
    """``inner`` (a TCPStore) with every value MAC'd under ``key`` (:func:`store_key`).
    ``where`` names the store in the intrusion line (e.g. "worker store at 10.0.0.1:4000");
    ``tolerant``: a forged value is absent, not fatal (module docstring)."""

    def __init__(self, inner: dist.Store, key: bytes, where: str = "the store", *,
                 tolerant: bool = False, memory: _Memory | None = None):
        super().__init__()
        self.inner, self._key, self.where, self.tolerant = inner, key, where, tolerant
        self._mem = memory or _Memory()
        _ALIVE.append(self)

    # -- the MAC
    def _tag(self, key: str, body: bytes) -> bytes:
        k = key.encode("utf-8")
        return hmac.new(self._key, len(k).to_bytes(4, "big") + k + body, hashlib.sha256).digest()

    def _seal(self, key: str, value) -> bytes:
        body = secrets.token_bytes(_NONCE) + _bytes(value)
        return self._tag(key, body) + body

    def _value(self, key: str, sealed) -> bytes | None:
        """The value in stored bytes, or None when they carry no valid MAC (logged once per key;
        IntrusionError unless tolerant)."""
        sealed = _bytes(sealed)
        body = sealed[_MAC:]
        if len(sealed) >= _MAC + _NONCE and hmac.compare_digest(sealed[:_MAC], self._tag(key, body)):
            if self.tolerant:
                self._mem.remember(key, sealed)
            return body[_NONCE:]
        self._intrusion(key)
        return None

    def _open(self, key: str, sealed) -> bytes:
        value = self._value(key, sealed)
        return b"" if value is None else value

    def _intrusion(self, key: str):
        msg = (f"intrusion: {'ignored' if self.tolerant else 'refused'} key {key!r} in the "
               f"{self.where}: its value has no valid MAC under the job secret, so a process outside "
               f"the job wrote it (the store does not say who; keep its address private, "
               f"SECURITY.md)")
        if self.tolerant:
            msg += "; read as absent, the job goes on with the genuine values"
        with self._mem.lock:
            first = key not in self._mem.logged
            self._mem.logged.add(key)
        if first:
            print(f"allhands: {msg}", file=sys.stderr, flush=True)
        if not self.tolerant:
            raise IntrusionError(msg)

    def _current(self, key: str) -> tuple[bytes, bytes | None]:
        """(the stored bytes, b"" when absent; the value, None when absent or forged). A forged
        value is replaced by the last genuine bytes this process knows of the key, if any."""
        raw = _bytes(self.inner.compare_set(key, _PROBE, _PROBE))
        if raw == _PROBE:
            return b"", None
        value = self._value(key, raw)
        if value is None and self.tolerant:
            with self._mem.lock:
                known = self._mem.seen.get(key)
            if known is not None and _bytes(self.inner.compare_set(key, raw, known)) == known:
                with self._mem.lock:
                    first = "\0put " + key not in self._mem.logged
                    self._mem.logged.add("\0put " + key)
                if first:
                    print(f"allhands: intrusion: put the genuine value of key {key!r} back in the "
                          f"{self.where}", file=sys.stderr, flush=True)
                return known, self._value(key, known)
        return raw, value

    def _genuine(self, key: str, timeout: timedelta | None = None) -> bytes:
        """Wait (up to the store's timeout) until ``key`` holds a value with a valid MAC."""
        limit = (timeout or self.inner.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            raw, value = self._current(key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                msg = (f"intrusion: key {key!r} in the {self.where} held no genuine value for "
                       f"{limit:g} s (a process outside the job wrote it); the job stops here, "
                       f"resumable from its last checkpoint")
                print(f"allhands: {msg}", file=sys.stderr, flush=True)
                raise IntrusionError(msg)
            time.sleep(0.01)

    def _keep(self) -> None:
        """Start the keeper (once per process): puts back the keys this process wrote."""
        if not self.tolerant or self._mem.keeper is not None:
            return
        twin = MACStore(self.inner.clone(), self._key, self.where, tolerant=True, memory=self._mem)

        def keep() -> None:
            while not self._mem.closed.wait(KEEP_S):
                with self._mem.lock:
                    keys = list(self._mem.mine)
                try:
                    for key in keys:
                        raw, value = twin._current(key)
                        if not raw:  # deleted (its writer's hygiene): nothing to keep
                            self._mem.forget(key)
                except Exception:  # the store is gone: the job is over
                    return

        self._mem.keeper = threading.Thread(target=keep, name="allhands-store-keeper", daemon=True)
        self._mem.keeper.start()

    def _wrote(self, key: str, sealed: bytes) -> None:
        if self.tolerant:
            self._mem.remember(key, sealed, mine=True)
            self._keep()

    def close(self) -> None:
        """Stop the keeper (before the store's server goes away: it would log a lost connection)."""
        self._mem.closed.set()
        if self._mem.keeper is not None:
            self._mem.keeper.join(timeout=5)

    # -- torch.distributed.Store
    def set(self, key: str, value) -> None:
        sealed = self._seal(key, value)
        self.inner.set(key, sealed)
        self._wrote(key, sealed)

    def get(self, key: str) -> bytes:
        value = self._value(key, self.inner.get(key))  # waits for the key, as TCPStore does
        return value if value is not None else self._genuine(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = [self._value(k, v) for k, v in zip(keys, self.inner.multi_get(keys))]
        return [v if v is not None else self._genuine(k) for k, v in zip(keys, values)]

    def multi_set(self, keys: list[str], values: list) -> None:
        sealed = [self._seal(k, v) for k, v in zip(keys, values)]
        self.inner.multi_set(keys, sealed)
        for k, v in zip(keys, sealed):
            self._wrote(k, v)

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected = _bytes(expected)
        raw, value = self._current(key)  # a forged value is absent: swapped over like one
        if value is None and expected:
            return b""  # no swap, as TCPStore would answer
        if value is not None and (not expected or value != expected):
            return value
        sealed = self._seal(key, desired)
        got = _bytes(self.inner.compare_set(key, raw, sealed))
        if got == sealed:
            self._wrote(key, sealed)
            return _bytes(desired)
        return self._open(key, got)

    def _update(self, key: str, change) -> bytes:
        """Atomically replace the value of ``key`` by ``change(value)`` (b"" when absent)."""
        while True:
            raw, value = self._current(key)
            new = change(value if value is not None else b"")
            sealed = self._seal(key, new)
            if _bytes(self.inner.compare_set(key, raw, sealed)) == sealed:
                self._wrote(key, sealed)
                return new
            # another process wrote first: retry from what is there now

    def add(self, key: str, amount: int) -> int:
        return int(self._update(key, lambda v: str((int(v) if v else 0) + amount).encode()))

    def append(self, key: str, value) -> None:
        self._update(key, lambda v: v + _bytes(value))

    def check(self, keys: list[str]) -> bool:
        """Whether every key holds a value; in a tolerant store, a genuine one (an authenticated
        read: a forged value is absent)."""
        if not self.inner.check(keys):
            return False
        return not self.tolerant or all(self._current(k)[1] is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)
        if self.tolerant:
            for k in keys:
                self._genuine(k, timeout)

    def delete_key(self, key: str) -> bool:
        self._mem.forget(key)
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
        return MACStore(self.inner.clone(), self._key, self.where, tolerant=self.tolerant, memory=self._mem)

    # torch's C++ trampoline looks these two up by their C++ names.
    getNumKeys = num_keys
    deleteKey = delete_key


def sealed(store: dist.Store, secret: str | None, where: str, *, tolerant: bool = False,
           context: str | bytes = b"") -> dist.Store:
    """``store`` behind a :class:`MACStore` under ``secret`` (and ``context``); as is without
    one (--insecure)."""
    return store if not secret else MACStore(store, store_key(secret, context), where, tolerant=tolerant)
