"""The torch-version shims (dtlab.rank.compat) and the pipeline's p2p recorder, without a launch.

The pipeline recorder is driven by fake `_batch_p2p` / `_wait_batch_p2p` helpers that return what each backend
returns: one Work per op (gloo) or one Work for the whole batch (NCCL coalesces batch_isend_irecv; 1F1B fuses a
forward send with a backward receive). Every send and receive must end, with its bytes, either way.
"""

import os

import pytest
import torch
import torch.distributed as dist

from dtlab.rank import compat
from dtlab.rank.collectives import CommRecorder
from dtlab.rank.strategies import pp_p2p as pp


class Work:
    """A finished Work."""

    def wait(self):
        return True


class Op:
    """What a P2POp exposes to the recorder: the function (isend / irecv), the tensor and the peer."""

    def __init__(self, fn, n: int, peer: int):
        self.op, self.tensor, self.peer = fn, torch.zeros(n), peer


class Writer:
    def __init__(self):
        self.events = []

    def write(self, kind, **fields):
        self.events.append((kind, fields))


def _recorder(coalesced: bool, calls: list):
    def issue(ops, desc=None):
        calls.append((len(ops), desc))
        return [Work()] if coalesced else [Work() for _ in ops]

    def wait(works):
        for w in works:
            w.wait()

    return pp.P2PRecorder(issue, wait)


@pytest.mark.parametrize("coalesced", [False, True])
def test_every_send_and_receive_ends_with_its_bytes_whatever_the_backend_returns(coalesced):
    calls, writer = [], Writer()
    rec = CommRecorder(writer, 0)
    pp.ACTIVE["recorder"] = rec
    try:
        p2p = _recorder(coalesced, calls)
        rec.begin(0, rec._ref)
        works = p2p.batch_p2p([Op(dist.isend, 8, 1), Op(dist.irecv, 16, 1)], desc="fwd_send_bwd_recv")
        assert len(works) == (1 if coalesced else 2)
        p2p.wait_p2p(works)
        rec.flush()
    finally:
        pp.ACTIVE["recorder"] = None
    done = [f for kind, f in writer.events if kind == "collective"]
    assert sorted((f["op"], f["nbytes"], f["phase"]) for f in done) == [
        ("recv", 64, "backward"),
        ("send", 32, "forward"),
    ]
    assert all(f["t_end"] is not None and f["t_end"] >= f["t_start"] for f in done)
    assert not p2p.open  # nothing left waiting for a Work that will never come


def test_the_communicator_warm_up_is_not_counted_as_pipeline_traffic():
    calls, writer = [], Writer()
    rec = CommRecorder(writer, 0)
    pp.ACTIVE["recorder"] = rec
    try:
        p2p = _recorder(False, calls)
        p2p.wait_p2p(p2p.batch_p2p([Op(dist.isend, 1, 1), Op(dist.irecv, 1, 1)]))  # desc None: the warm-up
        rec.flush()
    finally:
        pp.ACTIVE["recorder"] = None
    assert calls == [(2, None)]  # it was issued
    assert not [f for kind, f in writer.events if kind == "collective"]  # and not recorded


def test_a_helper_that_calls_itself_is_recorded_once():
    writer = Writer()
    rec = CommRecorder(writer, 0)
    holder = {}

    def issue(ops, desc=None):  # a torch whose _batch_p2p goes through the module's (wrapped) name again
        if desc == "fwd_send":
            return holder["p2p"].batch_p2p(ops, desc="fwd_send_inner")
        return [Work() for _ in ops]

    pp.ACTIVE["recorder"] = rec
    try:
        holder["p2p"] = p2p = pp.P2PRecorder(issue, lambda works: None)
        p2p.wait_p2p(p2p.batch_p2p([Op(dist.isend, 4, 1)], desc="fwd_send"))
        rec.flush()
    finally:
        pp.ACTIVE["recorder"] = None
    assert [f["nbytes"] for kind, f in writer.events if kind == "collective"] == [16]


def test_pipeline_transfers_are_told_by_their_direction():
    assert all(compat.is_pipeline_transfer(d) for d in ("fwd_send", "bwd_recv", "fwd_send_bwd_recv", "bwd_send"))
    assert not any(compat.is_pipeline_transfer(d) for d in (None, "", "init"))


def test_checkpoint_bytes_are_this_ranks_storage_files(tmp_path):
    for name, n in (
        ("__0_0.distcp", 100),
        ("__0_1.distcp", 50),
        ("__1_0.distcp", 70),
        ("__10_0.distcp", 9),
        (".metadata", 30),
    ):
        (tmp_path / name).write_bytes(b"x" * n)
    assert compat.checkpoint_bytes_written(str(tmp_path), 0) == 150
    assert compat.checkpoint_bytes_written(str(tmp_path), 1) == 70  # not rank 10's file
    assert compat.checkpoint_bytes_written(str(tmp_path), 10) == 9


def test_adamw_implementations_map_to_torchs_arguments():
    assert compat.adamw_kwargs("auto") == {}
    assert compat.adamw_kwargs("foreach") == {"foreach": True}
    assert compat.adamw_kwargs("fused") == {"fused": True}
    assert compat.adamw_kwargs("for-loop") == {"foreach": False}
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert compat.default_adamw_impl([{"params": params}]) == "for-loop"  # CPU tensors


def test_a_model_of_plain_tensors_keeps_one_group():
    ps = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    groups = compat.param_groups_by_kind(iter(ps))
    assert len(groups) == 1 and groups[0]["params"] == ps


def test_dtensors_and_plain_tensors_get_a_group_each_and_foreach_adamw_steps(tmp_path):
    """A one-rank gloo group in this process: a DTensor weight beside a plain bias, as tensor parallelism has."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from dtlab.rank.optim import adamw

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
        b = torch.nn.Parameter(torch.ones(2))
        groups = compat.param_groups_by_kind([b, w])
        assert [isinstance(g["params"][0], DTensor) for g in groups] == [True, False]
        opt = adamw([b, w], 0.1, "foreach")
        (w.redistribute(mesh, [Replicate()]).to_local().sum() + b.sum()).backward()
        opt.step()  # one group mixing both kinds raises "got mixed torch.Tensor and DTensor"
        # AdamW's first step: p (1 - lr x weight decay 0.01) - lr x sign(g) = 1 - 0.001 - 0.1 on every element
        assert torch.allclose(b.detach(), torch.full((2,), 0.899))
        assert torch.allclose(w.full_tensor(), torch.full((4, 2), 0.899))
    finally:
        dist.destroy_process_group()
