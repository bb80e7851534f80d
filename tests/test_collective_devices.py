"""allhands' own collectives on a GPU, checked on this CPU: every one goes through
``allhands.collective``, which knows each group's device, and builds its tensors there.

A CUDA world is imitated by a backend registered for the "cuda" device only, wrapping torch's
fake process group: as under NCCL, a real CPU tensor sent on it raises "No backend type
associated with device type cpu". Under ``FakeTensorMode`` tensors can claim device "cuda" on
this CPU-only build, but hold no values: a function runs through its collectives and stops at
the first value it reads, or at a copy to the (absent) GPU (``past_the_collectives``). Fake
tensors skip torch's backend lookup, so a spy on torch's collectives records the device of
every tensor sent, and the tests compare that with the group's.

The replica quorum and the parameter server send GPU tensors over gloo groups: a recording
stand-in for such a group shows that what reaches it is on the host.

The mesh's own groups (2 gloo processes): registered with their device, and every group under
the job's timeout, which torch does not pass to a DeviceMesh's groups by itself.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode)
from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg

from allhands import collective
from allhands.checkpoint.checkpointer import _agree
from allhands.evaluate import check_replicas, evaluate
from allhands.memory import log_memory
from allhands.parallel.pipeline import global_grad_norm
from allhands.ps.wire import Wire
from allhands.replica.heal import _bcast_coalesced
from allhands.replica.quorum import Quorum, ReplicaQuorum
from allhands.steplog import StepLog

CUDA = torch.device("cuda")


@pytest.fixture
def cuda_world():
    """A default group of 2 ranks (this process is rank 0) that, like NCCL, serves cuda only;
    registered with its device as the mesh registers it. Yields a subgroup of both ranks."""
    if not hasattr(dist.Backend, "FAKECUDA"):
        dist.Backend.register_backend("fakecuda", _create_fake_pg, extended_api=True, devices=["cuda"])
    assert not dist.is_initialized()
    dist.init_process_group("fakecuda", store=FakeStore(), rank=0, world_size=2)
    try:
        collective.register(dist.group.WORLD, CUDA)
        yield dist.new_group([0, 1])
    finally:
        dist.destroy_process_group()


@pytest.fixture
def sent(monkeypatch):
    """[(collective, device type of each tensor)] of every all_reduce / all_gather made."""
    seen: list[tuple[str, tuple[str, ...]]] = []

    def spy(name, real):
        def call(*args, **kwargs):
            tensors = [a for a in args if torch.is_tensor(a)] + [t for a in args if isinstance(a, list) for t in a]
            seen.append((name, tuple(sorted({t.device.type for t in tensors}))))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(dist, "all_reduce", spy("all_reduce", dist.all_reduce))
    monkeypatch.setattr(dist, "all_gather", spy("all_gather", dist.all_gather))
    return seen


def past_the_collectives(fn) -> None:
    """Run ``fn`` with fake tensors; a value read (which fake tensors cannot answer) or a copy
    to the GPU ends it, and is the only way it may end early: any other error raises on."""
    try:
        with FakeTensorMode():
            fn()
    except (DataDependentOutputException, DynamicOutputShapeException):
        pass
    except RuntimeError as e:  # a host-to-GPU copy, or float() of a CUDA scalar, asks the real runtime
        if "not linked with support for cuda" not in str(e):
            raise


def _mesh(group) -> SimpleNamespace:
    return SimpleNamespace(device=CUDA, world_size=2, node_local_rank=1, dp_rank=0, dp_size=2,
                           group=lambda dim: group, size=lambda dim: 2)


# --------------------------------------------------------------------------- call sites


def test_evaluate_reduces_on_the_default_groups_device(cuda_world, sent):
    """The default config evaluates before step 1: on a GPU its all_reduce must carry a CUDA
    tensor (today's code sent the float64 host total, which NCCL refuses)."""
    layout = SimpleNamespace(mesh=_mesh(cuda_world), eval=lambda: None, train=lambda: None,
                             autocast=contextlib.nullcontext, reports_loss=False)
    past_the_collectives(lambda: evaluate(layout, None, None, 0, to_device=lambda b: b))
    assert sent == [("all_reduce", ("cuda",))]


def test_check_replicas_gathers_on_the_groups_device(cuda_world, sent):
    def run():
        part = nn.Module()
        part.w = nn.Parameter(torch.zeros(3, device="cuda"))
        check_replicas([part], _mesh(cuda_world), "dp", step=1)
    past_the_collectives(run)
    assert sent == [("all_gather", ("cuda",))]


def test_log_memory_gathers_on_the_default_groups_device(cuda_world, sent):
    held = {"params": 1, "grads": 2, "optim": 3, "numel": 4}
    mesh = SimpleNamespace(world_size=2, size=lambda dim: 2)
    past_the_collectives(lambda: log_memory(None, held, nn.Module(), mesh, zero=0, step=1))
    assert sent == [("all_gather", ("cuda",))]


def test_a_logged_steps_record_is_gathered_on_the_default_groups_device(cuda_world, sent, monkeypatch):
    monkeypatch.setattr("allhands.steplog.peak_memory", lambda device: (0, "none"))
    log = StepLog(_mesh(cuda_world), global_batch=4)
    log.step_done(0.1)
    past_the_collectives(lambda: log.gather(step=1, loss_sum=1.0, gnorm=0.5, dt=0.1, comm=(0.0, 0.0, 0.0, 0.0),
                                            reports_loss=True, lr=1e-3, tokens_per_sample=None, counters={}))
    assert sent == [("all_gather", ("cuda",))]


def test_checkpoint_agreement_and_a_stage_without_gradients_reduce_on_the_device(cuda_world, sent):
    """The checkpointer's ok flag (it went to the GPU only under a backend named "nccl"), and
    the pipeline's norm on a stage holding no gradient (it stayed on the host)."""
    past_the_collectives(lambda: _agree(True))
    past_the_collectives(lambda: global_grad_norm([], pp_group=cuda_world))
    assert sent == [("all_reduce", ("cuda",)), ("all_reduce", ("cuda",))]


class _GlooLike:
    """Stands for a bare gloo group (the quorum's, the parameter server's): records the device
    of each tensor it is handed."""

    def __init__(self):
        self.seen: list[str] = []

    def _take(self, tensors, *_):
        self.seen += [t.device.type for t in tensors]
        return SimpleNamespace(wait=lambda: None)

    allreduce = broadcast = send = _take


@pytest.fixture
def gloo_like():
    return collective.register(_GlooLike(), "cpu")


def test_the_quorum_reduces_gpu_gradients_with_its_counters_on_the_host(gloo_like):
    """The joiners/stop counters ride in the gradients' buffer; on a GPU that buffer was a
    concatenation of CUDA gradients and a CPU tensor, which fails before any gloo call."""
    q = ReplicaQuorum(dist.HashStore(), 0, 1, timeout_s=1.0, dead_s=1.0, pg_timeout_s=1.0)
    q.quorum, q.pg = Quorum(1, (0,), (0,), (q.life,), 0), gloo_like
    past_the_collectives(lambda: q.allreduce([torch.zeros(3, device="cuda"), torch.zeros(2, 2, device="cuda")], 0))
    assert gloo_like.seen == ["cpu"]


@pytest.mark.parametrize("me", [0, 1], ids=["source", "receiver"])
def test_a_heal_moves_gpu_state_through_host_buckets(gloo_like, me):
    """A bucket of one dtype may hold a GPU's moments and AdamW's host ``step`` at once."""
    past_the_collectives(lambda: _bcast_coalesced(
        gloo_like, [torch.zeros(3, device="cuda"), torch.zeros(()), torch.zeros(2, device="cuda")], src=0, me=me))
    assert gloo_like.seen == ["cpu"]


def test_a_gpu_workers_message_to_a_server_leaves_from_the_host(gloo_like):
    past_the_collectives(lambda: Wire({0: (gloo_like, 1)}).send(torch.zeros(4, device="cuda"), 0, tag=2))
    assert gloo_like.seen == ["cpu"]


# --------------------------------------------------------------------------- the guard


def test_the_imitation_refuses_a_cpu_tensor_as_nccl_does(cuda_world):
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.zeros(2), group=cuda_world)


def test_a_cpu_tensor_on_a_cuda_group_is_refused_in_one_line_naming_the_call(cuda_world):
    with pytest.raises(collective.CollectiveDeviceError) as e:
        collective.all_reduce(torch.zeros(2), call="evaluate", group=cuda_world)
    msg = str(e.value)
    assert msg.startswith("evaluate: all_reduce of a cpu tensor on a group that serves cuda; ")
    assert "\n" not in msg
    # not a RuntimeError: the quorum and the parameter server take those for a lost peer
    assert not isinstance(e.value, RuntimeError)


def test_a_cuda_tensor_on_a_host_group_is_refused(cuda_world):
    host = collective.register(dist.new_group([0, 1]), "cpu")
    with FakeTensorMode():
        t = torch.zeros(2, device="cuda")
        with pytest.raises(collective.CollectiveDeviceError, match=r"^quorum: all_gather of a cuda "
                                                                   r"tensor on a group that serves cpu; "):
            collective.all_gather([torch.empty_like(t)] * 2, t, call="quorum", group=host)


def test_an_unregistered_group_serves_the_default_groups_device(cuda_world):
    assert collective.device(cuda_world) == CUDA  # made by new_group, registered by nobody
    assert collective.device() == CUDA
    collective._SERVES.clear()  # the default group unregistered too: torch's own view of it
    assert collective.device(cuda_world).type == "cuda"


def test_without_a_process_group_the_host_serves():
    assert not dist.is_initialized()
    assert collective.device() == torch.device("cpu")


def test_host_staging_keeps_a_host_tensor_and_copies_a_device_one():
    t = torch.arange(4.0)
    assert collective.to_host(t) is t
    assert not collective.host_empty(3, torch.float32, pinned=False).is_pinned()
    with FakeTensorMode():
        got = collective.to_host(torch.zeros(4, device="cuda"))
        assert got.device.type == "cpu" and got.shape == (4,)


# --------------------------------------------------------------------------- the mesh's groups


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _mesh_rank(rank: int, out: str) -> None:
    from allhands.env import INSECURE_ENV
    from allhands.mesh import Mesh
    os.environ[INSECURE_ENV] = "1"
    torch.set_num_threads(1)
    # a file store: no port to pick beforehand, and no rank's exit takes it away from the other
    store = dist.FileStore(os.path.join(out, "store"), 2)
    got = {}
    # tp over both ranks (the dp flatten and every other dim: groups of one), then ep over both
    for name, layout in (("tp", {"tp": 2, "dp_replicate": 1}), ("ep", {"dp_shard": 2, "dp_replicate": 1, "ep": 2})):
        mesh = Mesh.build(rank=rank, world_size=2, local_rank=rank, device="cpu", backend="gloo",
                          timeout_s=7, store=dist.PrefixStore(name, store), **layout)
        groups = {d: mesh.group(d) for d in (*mesh.DIMS, "dp", *(("ep", "edp") if name == "ep" else ()))}
        groups.update(world=dist.group.WORLD, checkpoint=mesh.checkpoint_group(), cpu=mesh.cpu_group())
        got[name] = {d: [_timeout(g).total_seconds(), collective.device(g).type] for d, g in groups.items()}
        mesh.destroy()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(got, f)
    store.add("finished", 1)  # neither leaves while the other may still be making a group
    while store.add("finished", 0) < 2:
        time.sleep(0.05)
    os._exit(0)  # no teardown: gloo's threads can abort a process exiting normally (SIGABRT)


def test_every_group_of_the_mesh_has_the_jobs_timeout_and_its_device(tmp_path):
    """torch 2.13 makes a DeviceMesh's groups with its own default timeout (30 min under gloo),
    not the default group's: the mesh hands the job's timeout to each one."""
    mp.start_processes(_mesh_rank, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        for layout, groups in got.items():
            for dim, (timeout_s, device) in groups.items():
                assert (timeout_s, device) == (7.0, "cpu"), (rank, layout, dim)
