"""MACStore on a real TCPStore, in this process: values round-trip through torch's PrefixStore,
a value written without the job secret is refused and named once, counters stay atomic."""

from __future__ import annotations

import threading
import time
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


def _tolerant(server, secret="s" * 32) -> MACStore:
    return MACStore(_client(server), store_key(secret), "quorum store", tolerant=True)


def test_a_tolerant_store_reads_forged_values_as_absent_and_logs_each_key_once(server, capfd):
    """What decides in replica mode (``done``, a vote ``d/E/S``, ``joiners``) is read through
    ``check``/``compare_set``/``add``: a stranger's value is absent there, never a decision."""
    store = _tolerant(server)
    server.set("done", b"59")  # created by a stranger, no MAC
    server.set("d/1/5", b"abort")  # voted ahead
    MACStore(_client(server), store_key("t" * 32), "x").set("joiners", b"7")  # another secret
    assert not store.check(["done"]) and not store.check(["done"])
    assert store.compare_set("d/1/5", "", "commit") == b"commit" and store.get("d/1/5") == b"commit"
    assert store.compare_set("d/1/5", "", "abort") == b"commit"  # genuine now: one outcome
    assert store.add("joiners", 1) == 1
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("allhands:")]
    assert len(err) == 3 and all("intrusion: ignored key" in ln and "read as absent" in ln for ln in err), err


def test_a_tolerant_store_puts_overwritten_genuine_values_back(server, capfd):
    """A genuine key overwritten by a stranger: a reader that saw it writes it back (over the
    forged bytes only); the writer's keeper does so without any read."""
    a, b = _tolerant(server), _tolerant(server)
    a.set("life/0", "abc")
    assert b.get("life/0") == b"abc" and b.add("joiners", 2) == 2
    server.set("life/0", b"forged")
    server.set("joiners", b"9")
    assert b.get("life/0") == b"abc" and b.add("joiners", 1) == 3
    a.set("epoch", "4")
    server.set("epoch", b"1")
    deadline = time.monotonic() + 60  # the keeper runs every KEEP_S (0.25 s): only a hang guard
    while server.get("epoch") == b"1":  # a's keeper puts its own key back
        assert time.monotonic() < deadline, "the writer's keeper did not put its key back"
        time.sleep(0.05)
    assert _tolerant(server).get("epoch") == b"4"
    assert "put the genuine value of key 'life/0' back" in capfd.readouterr().err


def test_a_forged_value_nobody_saw_is_waited_for_then_named(server):
    store = MACStore(_client(server), store_key("s" * 32), "quorum store", tolerant=True)
    server.set("q/3/members", b"0:1:x")
    writer = threading.Timer(0.3, lambda: _tolerant(server).set("q/3/members", "0:4:life"))
    writer.start()
    assert store.get("q/3/members") == b"0:4:life"  # the genuine one, once written
    server.set("pid/0/1", b"666")
    store.set_timeout(timedelta(seconds=0.5))
    with pytest.raises(IntrusionError, match="'pid/0/1' .* held no genuine value for 0.5 s"):
        store.get("pid/0/1")
