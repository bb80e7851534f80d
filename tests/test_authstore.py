"""MACStore on a real TCPStore, in this process: values round-trip through torch's PrefixStore,
a value written without the job secret is refused and named once, counters stay atomic."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from allhands.authstore import IntrusionError, MACStore, sealed, store_key


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=10))


def test_values_round_trip_through_torchs_prefix_store_and_are_sealed(server):
    store = dist.PrefixStore("/worker/attempt_0", sealed(_client(server), "s" * 32, "worker store"))
    store.set("k", b"value")
    assert store.get("k") == b"value"
    raw = server.get("/worker/attempt_0/k")
    assert raw.endswith(b"value") and len(raw) == 32 + 16 + 5  # MAC, nonce, value
    assert store.compare_set("c", "", "v1") == b"v1" and store.compare_set("c", "", "v2") == b"v1"
    assert store.compare_set("c", "v1", "v3") == b"v3" and store.compare_set("c", "x", "v4") == b"v3"
    store.append("l", b"ab")
    store.append("l", b"cd")
    assert store.get("l") == b"abcd" and store.multi_get(["k", "l"]) == [b"value", b"abcd"]
    assert sealed(server, None, "x") is server  # --insecure: the store as is


def test_a_value_without_the_secret_is_refused_and_named_once(server, capfd):
    store = MACStore(_client(server), store_key("s" * 32), "worker store at 127.0.0.1:1")
    server.set("/forged", b"10.9.9.9:4242")  # as a stranger writes it: no MAC
    MACStore(server, store_key("t" * 32), "other").set("/other", b"x")  # another secret
    for key in ("/forged", "/forged", "/other"):
        with pytest.raises(IntrusionError, match=f"refused key '{key}' in the worker store"):
            store.get(key)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and all(ln.startswith("allhands: intrusion: refused key") for ln in err)
    with pytest.raises(IntrusionError):
        store.add("/forged", 1)  # a counter is checked too


def test_counters_stay_atomic_under_concurrent_adds(server):
    key = store_key("s" * 32)
    stores = [MACStore(_client(server), key, "w") for _ in range(3)]
    results: list[int] = []

    def count(s: MACStore) -> None:
        results.extend(s.add("n", 1) for _ in range(60))

    threads = [threading.Thread(target=count, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stores[0].add("n", 0) == 180 and sorted(results) == list(range(1, 181))
