"""ZeRO-3 on one GPU, decided on CPU: where its ranks go for a given GPU count and NCCL version, lab 4's configs
(quick and full) and its calibration, the LOCAL_RANK DeepSpeed is given, DeepSpeed's accelerator, and where
the collectives' end marks are taken on GPU paths (with tests/fake_cuda.py)."""

import sys
import types

import pytest
import torch

import dtlab
from dtlab.config.calibration import CalibConfig
from dtlab.course.labs import calibration_ranks, config_for, lab_parts

OLD, NEW = "2.28.9", "2.30.1"  # torch 2.11's pinned NCCL; the first NCCL that lets 2 ranks share a GPU


@pytest.mark.parametrize(
    "ngpu,nccl,nproc,expect",
    [
        (1, OLD, None, ("gloo", "cuda", 2, 2)),  # the classroom GPU: 2 gloo ranks on CUDA tensors share it
        (1, NEW, None, ("nccl", "cuda", 2, 1)),  # NCCL's multi-rank mode
        (4, OLD, None, ("nccl", "cuda", 4, 4)),  # one rank per GPU
        (0, None, None, ("gloo", "cpu", 2, 0)),
        (1, OLD, 1, ("nccl", "cuda", 1, 1)),  # asked for one rank: allowed, and labelled
    ],
)
def test_zero3_placement_for_gpu_count_and_nccl(ngpu, nccl, nproc, expect):
    cfg = dtlab.tiny(strategy="zero3", baseline_steps=0, nproc=nproc)
    cfg.validate(cuda_device_count=ngpu, nccl_version=nccl)  # refused on gloo-on-CUDA before: never again
    p = cfg.placement(ngpu, nccl)
    backend, device, ranks, per_gpu_or_gpus = expect
    assert (p.backend, p.device, cfg.nproc) == (backend, device, ranks)
    if backend == "gloo" and device == "cuda":
        assert p.ranks_per_gpu == per_gpu_or_gpus and "DeepSpeed's CUDA accelerator over gloo" in p.note
    if backend == "nccl" and ngpu == 1 and ranks == 2:
        assert p.env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    if ranks == 1:
        assert "partitions nothing" in p.note
    if device == "cuda":
        assert "CUDA events" in p.timing


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("ngpu,nccl", [(0, None), (1, OLD), (1, NEW), (8, OLD)])
def test_lab04_compares_zero3_and_ddp_at_the_same_ranks_and_calibrates(quick, ngpu, nccl):
    """Lab 4's three launches on every machine: ZeRO-3, DDP with ZeRO-3's ranks, a calibration at those ranks.
    Before: one GPU ran ZeRO-3 on one rank (nothing sharded) and then calibrate(nproc=1) was refused; in quick
    mode ZeRO-3 on 2 ranks of one GPU was refused outright."""
    z3 = config_for(ngpu, quick, strategy="zero3", baseline_steps=0)
    ddp = config_for(ngpu, quick, nproc=z3.nproc)
    assert z3.nproc == ddp.nproc == max(2, ngpu if not quick else 2)
    for cfg in (z3, ddp):
        cfg.validate(cuda_device_count=ngpu, nccl_version=nccl)
    CalibConfig(nproc=calibration_ranks(z3), ops=("all_reduce", "all_gather", "reduce_scatter")).validate(ngpu)
    parts = {p["what"]: p for p in lab_parts("04", ngpu, nccl, quick=quick)}
    assert set(parts) == {"ZeRO-3 run", "DDP run", "calibration"}
    assert not any(p["label"].startswith("cannot run") for p in parts.values())
    assert parts["ZeRO-3 run"]["label"] == parts["DDP run"]["label"]  # same ranks, same place


def test_calibration_ranks_are_at_least_two():
    assert calibration_ranks(dtlab.tiny(nproc=1)) == 2 and calibration_ranks(dtlab.tiny(nproc=3)) == 3
    with pytest.raises(ValueError, match="one GPU hosts 2 ranks"):
        CalibConfig(nproc=1).validate(cuda_device_count=1)


def test_deepspeed_gets_the_gpu_index_as_local_rank(monkeypatch):
    """DeepSpeed sets its device from LOCAL_RANK: torchrun's 1 on a one-GPU machine would ask for cuda:1."""
    from dtlab.rank.strategies.zero3.engine import remap_local_rank

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("DTLAB_TORCHRUN_LOCAL_RANK", raising=False)
    p = dtlab.tiny(strategy="zero3", baseline_steps=0).placement(1, OLD)
    device = torch.device("cuda", p.device_index(1))
    assert remap_local_rank(device) == 1
    assert (torch.os.environ["LOCAL_RANK"], torch.os.environ["DTLAB_TORCHRUN_LOCAL_RANK"]) == ("0", "1")
    assert remap_local_rank(device) == 1  # idempotent: torchrun's value is kept
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("DTLAB_TORCHRUN_LOCAL_RANK", "3")
    assert remap_local_rank(torch.device("cpu")) == 3 and torch.os.environ["LOCAL_RANK"] == "3"


def test_deepspeed_accelerator_follows_the_device_not_the_backend(monkeypatch):
    """gloo on CUDA tensors needs DeepSpeed's CUDA accelerator (its tensors live on the GPU)."""
    from dtlab.rank.strategies.zero3 import engine

    fake = types.ModuleType("deepspeed")
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    monkeypatch.setitem(sys.modules, "deepspeed.comm", types.ModuleType("deepspeed.comm"))
    monkeypatch.setitem(sys.modules, "deepspeed.comm.torch", types.ModuleType("deepspeed.comm.torch"))
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert engine.import_deepspeed("cuda") is fake and torch.os.environ["DS_ACCELERATOR"] == "cuda"
    with pytest.raises(RuntimeError, match="need 'cpu'"):
        engine.import_deepspeed("cpu")


def test_nccl_collective_end_is_taken_on_an_owned_stream_per_group():
    """ZeRO-3 on NCCL: the end mark of an async collective is an event on dtlab's own stream for its group,
    made to wait on the CUDA future at issue, not on the pool stream a CUDA future's callback would get."""
    from fake_cuda import Clock, FakeCudaFuture, FakeTorch, make_owned

    from dtlab.rank.marks import Marks
    from dtlab.rank.strategies.zero3.comm import CollectiveRecorder

    clock, calls = Clock(0.0), []
    fake = FakeTorch(clock)
    marks = Marks(torch.device("cuda", 0), "nccl", torch_mod=fake, clock=clock, make_stream=make_owned(calls))
    rec = CollectiveRecorder(torch.device("cuda", 0), marks=marks)

    class Work:
        def get_future(self):
            return FakeCudaFuture(fake.cuda)

        def wait(self):
            return True

    class Backend:
        def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
            return Work()

    b = Backend()
    rec.install(b)
    start = fake.cuda.Event()
    start.record()
    rec.begin(0, "forward", start)
    g = object()
    clock.t = 0.5
    b.all_gather_into_tensor(torch.zeros(4), torch.zeros(2), g, True)
    b.all_gather_into_tensor(torch.zeros(4), torch.zeros(2), group=g, async_op=True)
    b.all_gather_into_tensor(torch.zeros(4), torch.zeros(2), group=None, async_op=True)
    out = rec.collect()
    assert [r["t_end"] for r in out] == [0.5] * 3 and all(r["async_op"] for r in out)
    assert [s.name for s in fake.cuda.waits] == ["owned1", "owned1", "owned2"] and len(calls) == 2  # per group
