"""fault.mode = "replica": the per-step quorum (in-process, threads on one store) and a 2-group job
whose group 1 is SIGKILLed inside the cross-group all-reduce: the survivor never restarts, the
step is discarded and redone, the restarted group heals from the survivor, and both end with the
parameters and optimizer state of each other, and the parameters of a single-process reference
that follows the stated batch rule (the global batch is kept, re-split over the live groups)."""

from __future__ import annotations

import datetime
import gc
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from allhands.admission import AdmissionError
from allhands.authstore import IntrusionError, MACStore, store_key
from allhands.checkpoint import committed
from allhands.checkpoint.safe import SafeFileSystemReader
from allhands import netlab
from allhands.config import load_config, validate
from allhands.errors import ConfigError
from allhands.faults import fired_at
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.replica.heal import ReplicaGroup
from allhands.mesh import Mesh
from allhands.replica.quorum import Quorum, ReplicaQuorum
from allhands.trainer import Job, Trainer

from isolation import exclusive
from conftest import ALLHANDS, TINY, tiny_config
from test_parity import max_rel_diff, reference_params


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _quorum(master, group, n=2, timeout_s=0.3, dead_s=30.0):
    """A group's own client of the store, as each group's worker process has."""
    tcp = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    return ReplicaQuorum(MACStore(tcp, store_key("test-secret"), "test store"), group, n,
                         timeout_s=timeout_s, dead_s=dead_s, pg_timeout_s=10)


def _in_threads(*fns):
    out, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_quorum_slots_keep_the_global_batch():
    q = Quorum(3, (0, 2), (5, 5), ("a", "b"), 0)
    assert q.slots(0, 3) == [0, 2] and q.slots(2, 3) == [1]
    alone = Quorum(4, (1,), (5,), ("c",), 0)
    assert alone.slots(1, 2) == [0, 1]
    assert Quorum.decode(7, Quorum(7, (0, 1), (3, 9), ("x", "y"), 2).encode()).source == 1


def test_quorum_forms_reduces_and_lets_a_joiner_in():
    store = _store()
    a, b = _quorum(store, 0), _quorum(store, 1)
    qa, qb = _in_threads(lambda: a.form(0), lambda: b.form(0))
    assert qa == qb and qa.members == (0, 1)
    ga, gb = [torch.full((3,), 1.0)], [torch.full((3,), 2.0)]
    oks = _in_threads(lambda: a.allreduce(ga, 0), lambda: b.allreduce(gb, 0))
    assert oks == [True, True] and torch.equal(ga[0], torch.full((3,), 3.0)) and torch.equal(ga[0], gb[0])
    assert not a.reform and not b.reform
    # group 1 restarts (a new incarnation) and asks to join: it may not close a quorum of its
    # own while group 0 is alive, and the next all-reduce tells both members to re-form
    b2 = _quorum(store, 1)
    joined = {}
    t = threading.Thread(target=lambda: joined.setdefault("q", b2.form(0)))
    t.start()
    t.join(1.0)
    assert t.is_alive(), "a joiner closed a quorum beside a live one"
    q3 = a.form(1)  # group 0 re-forms (its old peer b is gone) and lets b2 in
    t.join(30)
    assert joined["q"] == q3 and q3.members == (0, 1) and q3.steps == (1, 0) and q3.source == 0


def test_a_step_one_member_failed_is_discarded_by_all():
    store = _store()
    a, b = _quorum(store, 0), _quorum(store, 1)
    q, _ = _in_threads(lambda: a.form(0), lambda: b.form(0))
    # b's all-reduce failed; a's completed: the stored decision is one for both
    verdicts = _in_threads(lambda: a._decide(q, 4, True), lambda: b._decide(q, 4, False))
    assert verdicts == [b"abort", b"abort"]
    assert a._decide(q, 5, True) == b"abort"  # b never reduced step 5: a gives up alone


@pytest.mark.serial  # times the survivor's re-form: quorum_timeout_s, not dead_s or the gloo timeout
def test_a_peer_gone_between_steps_the_survivor_redoes_the_step_alone():
    store = _store()
    a, b = _quorum(store, 0), _quorum(store, 1)
    _in_threads(lambda: a.form(3), lambda: b.form(3))
    b.pg = b = None  # group 1 is gone after step 3: its connections close
    gc.collect()
    t0 = time.monotonic()
    assert not a.allreduce([torch.ones(3)], 3) and a.reform  # step 4 is discarded
    q = a.form(3)  # group 0 alone, after quorum_timeout_s
    assert q.members == (0,) and q.qid == 2
    g = [torch.full((3,), 2.0)]
    assert a.allreduce(g, 3) and torch.equal(g[0], torch.full((3,), 2.0))
    assert time.monotonic() - t0 < 10


def test_replica_mode_refuses_layouts_it_does_not_support(token_dir, tmp_path):
    for extra in ("parallel.tp=2", "parallel.sync=local_sgd", "parallel.zero=1"):
        cfg = tiny_config(token_dir, tmp_path, "fault.mode=replica", extra)
        with pytest.raises(ConfigError, match="fault.mode=replica"):
            validate(cfg)


def test_a_group_alone_keeps_the_global_batch(token_dir, tmp_path):
    """In-process: group 0 of 2 trains every step alone (its peer never comes): it computes both
    shares of each global batch, and ends bit-equal to the reference of the stated rule."""
    cfg = tiny_config(token_dir, tmp_path / "run", "run.steps=5", "fault.mode=replica")
    (tmp_path / "run").mkdir()
    mesh = Mesh.build(rank=0, world_size=1, local_rank=0, device="cpu", backend="gloo")
    try:
        trainer = Trainer(cfg, Job(), mesh, tmp_path / "run")
        master = _store()
        ReplicaGroup(_quorum(master, 0, n=2, timeout_s=0.05), trainer)
        trainer.fit()
        got = {k: v.detach() for k, v in trainer.raw_model.state_dict().items()}
    finally:
        mesh.destroy()
    ref = reference_params(cfg, shares=2)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def saved(run_dir: Path) -> dict[str, torch.Tensor]:
    """The last committed checkpoint of a group, every entry, flattened (``model.optim.state...``)."""
    step, path = committed(run_dir / "checkpoints")[-1]
    return flatten_state_dict(_load_state_dict_from_keys(storage_reader=SafeFileSystemReader(path)))[0]


def test_kill_inside_the_allreduce_survivor_carries_on_and_the_replacement_heals(token_dir, tmp_path, capfd):
    # group 1 SIGKILLs itself after the forward of step 4, while group 0 waits in the all-reduce;
    # min_groups=2: the survivor waits in memory for the replacement, which heals from it
    cfg = tiny_config(token_dir, tmp_path / "run", "run.steps=8", "fault.mode=replica",
                      "fault.max_restarts=1", "fault.inject=1:4:SIGKILL", "parallel.timeout_s=30",
                      "fault.quorum_timeout_s=0.5", "fault.min_groups=2")
    done = train_job(cfg, LaunchSpec(nproc=2))
    err = capfd.readouterr().err
    run = Path(done.run.dir)
    assert "replica group 0: step 4 discarded by every member" in err, err[-3000:]
    assert "replica group 1: quorum" in err and "healed from group 0" in err, err[-3000:]
    # the survivor's worker never restarted; group 1's did, once
    assert not (run / "logs" / "restarts.jsonl").exists()
    assert len((run / "replicas" / "group-1" / "logs" / "restarts.jsonl").read_text().splitlines()) == 1
    a, b = saved(run), saved(run / "replicas" / "group-1")
    assert int(a["train.step"]) == int(b["train.step"]) == 8
    model_keys = [k for k in a if k.startswith("model.")]
    assert any(k.startswith("model.optim.state.") for k in model_keys), model_keys[:5]
    for k in model_keys:  # parameters and optimizer state, bit for bit
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k
    ref = reference_params(done, shares=2)
    got = {k.removeprefix("model.model."): v for k, v in a.items() if k.startswith("model.model.")}
    assert set(got) == set(ref), (sorted(got)[:3], sorted(ref)[:3])
    # equal up to the rounding of where the shares are summed (gloo vs one process's
    # accumulation); a lost, doubled or half-applied step is orders of magnitude more
    assert max_rel_diff(got, ref) <= 1e-5, max_rel_diff(got, ref)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m][-1] == 8


# --------------------------------------------------------------------------- admission of the quorum


def test_a_forged_gloo_record_in_the_quorums_prefix_is_refused(capfd):
    """A stranger who reaches the store plants rank 1's connection record of the next quorum's
    gloo group (a genuine record replayed under that key): it carries no valid MAC for that key,
    so group 0 refuses it, names it, and never dials the address it holds."""
    store = _store()
    a, b = _quorum(store, 0), _quorum(store, 1)
    _in_threads(lambda: a.form(0), lambda: b.form(0))  # quorum 1: its gloo records show the keys
    raw = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    genuine = [k for k in raw.list_keys() if k.startswith("pg/1/") and k.endswith("/1")]
    assert genuine, raw.list_keys()
    for k in genuine:  # quorum 2's keys, written before any member of quorum 2 writes its own
        raw.set("pg/2/" + k.removeprefix("pg/1/"), raw.get(k))
    with pytest.raises((IntrusionError, RuntimeError), match="intrusion|MAC"):
        a._group(Quorum(2, (0, 1), (0, 0), (a.life, "stranger"), 0))
    assert re.search(r"intrusion: refused key 'pg/2/\S+' in the test store: its value has no valid MAC",
                     capfd.readouterr().err)


def test_a_stranger_in_the_quorums_group_is_refused_by_admission():
    """On a store without MACs (so the stranger could write its records), the member that holds
    the job's replica secret and the one that does not both stop before any gradient is summed:
    the quorum's gloo group is admitted like every other group of the job."""
    store = _store()

    def member(group, secret):
        tcp = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        q = ReplicaQuorum(tcp, group, 2, timeout_s=0.3, dead_s=30.0, pg_timeout_s=10, secret=secret)
        try:
            q.form(0)
        except AdmissionError as e:
            return str(e)
        return "admitted"

    genuine, stranger = _in_threads(lambda: member(0, "the-job-replica-secret"),
                                    lambda: member(1, "a-guess-at-the-secret!"))
    assert "refused rank 1" in genuine and "no valid proof" in genuine, genuine
    assert "refused rank 0" in stranger, stranger


# --------------------------------------------------------------------------- hard failures


def _bit_equal_and_reference(done, runs: list[Path], shares: int) -> None:
    """Every run directory's last checkpoint is at the final step, holds the same parameters and
    optimizer state bit for bit, and its parameters equal the stated rule's reference."""
    states = [saved(r) for r in runs]
    assert [int(s["train.step"]) for s in states] == [done.run.steps] * len(runs)
    for other in states[1:]:
        for k in (k for k in states[0] if k.startswith("model.")):
            v = states[0][k]
            assert torch.equal(v, other[k]) if torch.is_tensor(v) else v == other[k], k
    got = {k.removeprefix("model.model."): v for k, v in states[0].items() if k.startswith("model.model.")}
    assert max_rel_diff(got, reference_params(done, shares=shares)) <= 1e-5


def _finished(done, runs: list[Path]) -> list[Path]:
    """The run directories whose last checkpoint is at the final step (at least one)."""
    out = [r for r in runs if committed(r / "checkpoints") and int(saved(r)["train.step"]) == done.run.steps]
    assert out, "no group completed the job"
    return out


def _replica_job(token_dir, tmp_path, capfd, nproc: int, *extra: str):
    """A replica-mode job of ``nproc`` groups with short quorum timeouts: (config, stderr, run dir)."""
    cfg = tiny_config(token_dir, tmp_path / "run", "fault.mode=replica", "parallel.timeout_s=30",
                      "fault.quorum_timeout_s=0.5", *extra)
    done = train_job(cfg, LaunchSpec(nproc=nproc))
    return done, capfd.readouterr().err, Path(done.run.dir)


def _restarts(run: Path) -> int:
    f = run / "logs" / "restarts.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def test_the_joiner_killed_inside_its_heal_restarts_and_heals_again(token_dir, tmp_path, capfd):
    # group 1 dies at step 3; its replacement is SIGKILLed halfway through the heal from group 0
    done, err, run = _replica_job(token_dir, tmp_path, capfd, 2, "run.steps=6", "fault.max_restarts=2",
                                  "fault.inject=1:3:SIGKILL,1:2:heal-joiner", "fault.min_groups=2")
    assert set(fired_at(run)) == {"1:3:SIGKILL", "1:2:heal-joiner"}, err[-3000:]
    assert _restarts(run) == 0 and _restarts(run / "replicas" / "group-1") == 2, err[-3000:]
    assert "healed from group 0" in err, err[-3000:]
    _bit_equal_and_reference(done, [run, run / "replicas" / "group-1"], shares=2)


def test_the_source_killed_inside_a_heal_the_others_heal_again_from_the_next(token_dir, tmp_path, capfd):
    # group 2 dies at step 3; group 0, the source of its replacement's heal, dies halfway through
    # it. The heal leaves every receiver's state as it was: group 1 (a survivor) never restarts,
    # group 2's replacement heals again without a restart, both from group 1, the most advanced
    # left. min_groups=3: the quorum waits for every replacement, whatever a restart takes here.
    done, err, run = _replica_job(token_dir, tmp_path, capfd, 3, "run.steps=8", "fault.max_restarts=1",
                                  "fault.inject=2:3:SIGKILL,0:2:heal-source", "fault.min_groups=3")
    g1, g2 = run / "replicas" / "group-1", run / "replicas" / "group-2"
    assert set(fired_at(run)) == {"2:3:SIGKILL", "0:2:heal-source"}, err[-3000:]
    assert re.search(r"replica group 2: the heal in quorum \d+ failed", err), err[-3000:]
    assert re.search(r"replica group 2: quorum \d+ of groups 0, 1, 2 at step \d+ \(healed from group 1", err), \
        err[-3000:]
    assert (_restarts(run), _restarts(g1), _restarts(g2)) == (1, 0, 1), err[-3000:]
    _bit_equal_and_reference(done, [run, g1, g2], shares=3)


@pytest.mark.parametrize("inject,min_groups,backoff,wait", [("0:4:SIGKILL,1:4:SIGKILL", 2, 1, 0.5),
                                                           ("1:2:SIGKILL,0:3:SIGKILL", 1, 6, 30)],
                         ids=["every-group-at-once", "the-last-survivor"])
def test_with_no_live_group_left_they_restart_from_their_checkpoints(token_dir, tmp_path, capfd, inject,
                                                                     min_groups, backoff, wait):
    """The fallback: no live group holds the state, so the restarted ones resume from their own
    last checkpoints and the quorum forms again among them. Every group at once (both train every
    step together, both resume from step 2); or group 0 while it is the only live group
    (min_groups=1): group 1 dies inside step 2, group 0 trains on alone, commits step 2 and dies
    inside step 3. A 6 s restart backoff keeps group 1 away until group 0 has died, whatever the
    load (with 1 s, group 1 sometimes came back and group 0 healed from it instead). Group 1, back
    alone, may finish the job while group 0 still waits to restart: group 0's slot is then ended
    in its backoff, and its failure is on record all the same. There the first quorum waits up to
    30 s for both groups (a group the launcher saw die is not waited for): with 0.5 s, a loaded
    machine let group 0 start alone, and group 1, healing from it after step 2, never met its fault."""
    done, err, run = _replica_job(token_dir, tmp_path, capfd, 2, "run.steps=6", "fault.max_restarts=1",
                                  f"fault.inject={inject}", f"fault.min_groups={min_groups}",
                                  "checkpoint.interval=2", "checkpoint.mode=sync", f"fault.backoff_s={backoff}",
                                  f"fault.quorum_timeout_s={wait}")
    assert set(fired_at(run)) == set(inject.split(",")), err[-3000:]
    events = {g: [json.loads(x) for x in (r / "logs" / "restarts.jsonl").read_text().splitlines()]
              for g, r in ((0, run), (1, run / "replicas" / "group-1"))}
    assert [len(e) for e in events.values()] == [1, 1], err[-3000:]
    assert events[0][0]["resume_from"] == "checkpoint step 2", (events, err[-3000:])
    # no live group held the state when group 0 died: every quorum group 1 formed after its own
    # death came after group 0's (group 1, back alone first, may then train ahead and heal group 0)
    died = {g: err.index(f"replica group {g}: worker pid") for g in (0, 1)}
    back = [m.start() for m in re.finditer(r"replica group 1: quorum \d+ ", err) if m.start() > died[1]]
    assert all(at > died[0] for at in back), err[-3000:]
    if min_groups == 2:
        assert "resumed from step 2" in err, err[-3000:]
        assert events[1][0]["resume_from"] == "checkpoint step 2", (events, err[-3000:])
        _bit_equal_and_reference(done, [run, run / "replicas" / "group-1"], shares=2)
    else:  # group 1 died before its first checkpoint; a group still restarting when the other
        # completed the job ends without training
        assert events[1][0]["resume_from"].startswith("the start"), (events, err[-3000:])
        _bit_equal_and_reference(done, _finished(done, [run, run / "replicas" / "group-1"]), shares=2)


# --------------------------------------------------------------------------- across two hosts

LAB_REASON = netlab.unavailable()


@pytest.fixture(scope="module")
def lab():
    if LAB_REASON is not None:
        pytest.skip(f"network lab unavailable: {LAB_REASON}")
    with exclusive("netlab"), netlab.Lab(2, tag="ahr", prefix="10.67.0") as lab:
        yield lab


@pytest.mark.exclusive("netlab")
def test_across_two_hosts_the_killed_group_heals_over_the_link(lab, token_dir, tmp_path, cli_env):
    """One replica group per lab host, the quorum store on host 0's rendezvous endpoint: group 1
    (host 1) is SIGKILLed at step 3; host 0's group never stops, host 1's launcher restarts its
    worker, which heals from group 0 across the veth link."""
    run_dir = tmp_path / "run"
    sets = [*TINY, "run.steps=6", "fault.mode=replica", "fault.max_restarts=1", "fault.inject=1:3:SIGKILL",
            "parallel.timeout_s=30", "fault.quorum_timeout_s=0.5", "fault.min_groups=2",
            f"data.path={token_dir}", f"run.dir={run_dir}"]
    env = dict(cli_env, ALLHANDS_SECRET="lab-test-secret-" + "x" * 16, OMP_NUM_THREADS="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    procs = [host.popen([*ALLHANDS, "train", "--nnodes", "2", "--node-rank", str(r), "--nproc", "1",
                         "--rdzv-endpoint", f"{lab.hosts[0].addr}:29400", "--local-addr", host.addr,
                         *(x for s in sets for x in ("--set", s))], env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r, host in enumerate(lab.hosts)]
    out = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], out[0][-3000:] + out[1][-3000:]
    assert "quorum store at 10.67.0.1:29400; gloo on 10.67.0.2" in out[1], out[1][-3000:]
    assert re.search(r"replica group 1: quorum \d+ of groups 0, 1 at step \d+ \(healed from group 0",
                     out[1]), out[1][-3000:]
    assert _restarts(run_dir) == 0 and _restarts(run_dir / "replicas" / "group-1") == 1
    done = load_config(run_dir / "config.resolved.toml")
    _bit_equal_and_reference(done, [run_dir, run_dir / "replicas" / "group-1"], shares=2)
