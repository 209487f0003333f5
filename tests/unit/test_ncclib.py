"""The ranks' NCCL library rules that need no library (dtlab.config.ncclib): placement falls back to torch's header and
says so, the doctor's advice without a library, and the table of strategies NCCL's multi-rank mode is known to fail
for. The proofs with fake libnccl files compiled here and child processes: tests/integration/test_ncclib.py."""

import pytest

from dtlab.cli import doctor
from dtlab.config import ncclib, placement
from dtlab.config.ncclib import ENV, PRELOADED


@pytest.fixture
def clean_env(monkeypatch):
    for name in (ENV, PRELOADED, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _one_gpu(monkeypatch, header="2.28.9"):
    """A machine with one GPU whose torch was compiled against NCCL `header` (no GPU needed)."""
    monkeypatch.setattr(placement, "device_count", lambda: 1)
    monkeypatch.setattr(placement, "torch_nccl_header", lambda: header)


def test_without_a_library_placement_falls_back_to_the_header_and_says_so(clean_env):
    _one_gpu(clean_env, header="2.30.1")
    clean_env.setattr(ncclib, "loaded_library", lambda: None)  # a CUDA build of torch maps its own: none here
    with pytest.warns(UserWarning, match="no NCCL library found.*header version 2.30.1"):
        assert placement.machine_gpus() == (1, "2.30.1")
    clean_env.setattr(placement, "device_count", lambda: 0)
    assert placement.machine_gpus() == (0, None)  # no GPU: no NCCL read at all


BASE = {
    "python": "3.12.3",
    "torch": "2.11.0+cu130",
    "cuda_build": "13.0",
    "cpu_cores": 16,
    "gpus": [{"name": "NVIDIA H200", "memory_gib": 139.8}],
    "labs": {},
}


def test_the_doctor_without_a_library_gives_the_right_advice(clean_env):
    text = doctor.report({**BASE, "nccl": "2.28.9", "nccl_header": "2.28.9", "nccl_library": None})
    assert "NCCL library: none found" in text and "torch's header: 2.28.9, used for placement instead" in text
    assert "two ranks per GPU not allowed" in text and f"{ENV}=/path/to/libnccl.so.2" in text
    assert "pip install 'nvidia-nccl-cu13>=2.30'" in text
    assert "torch.cuda.nccl.version() cannot tell" in text and "shows (2, 30" not in text
    assert "warning: the ranks' NCCL library" not in text  # nothing to compare


def test_a_strategy_known_to_fail_on_a_shared_gpu_falls_back_to_gloo(monkeypatch):
    reason = "2 NCCL ranks sharing one H100, NCCL 2.30.7: init aborted (a measured failure)"
    monkeypatch.setitem(placement.NCCL_SHARED_GPU_FAILS, "zero3", reason)
    p = placement.plan(2, ngpu=1, nccl_version="2.30.7", strategy="zero3")
    assert (p.backend, p.device, p.ranks_per_gpu) == ("gloo", "cuda", 2) and p.env == {}
    assert reason in p.label and reason in p.note and "known to fail for 'zero3'" in p.label
    ddp = placement.plan(2, ngpu=1, nccl_version="2.30.7", strategy="ddp")
    assert ddp.backend == "nccl" and reason not in ddp.note  # only the strategy in the table
    asked = placement.plan(2, "nccl", ngpu=1, nccl_version="2.30.7", strategy="zero3")
    assert asked.backend == "nccl" and reason in asked.note  # asked for explicitly: runs, with the reason noted
    assert placement.plan(2, ngpu=2, nccl_version="2.30.7", strategy="zero3").backend == "nccl"  # one GPU each
    printed = doctor.report({**BASE, "nccl": "2.30.7", "labs": doctor.lab_placements(1, "2.30.7")})
    fell_back = "gloo on CUDA tensors, 2 ranks on 1 GPU(s), 2 per GPU; NCCL's multi-rank mode is known to fail for"
    assert f"ZeRO-3 run: {fell_back} 'zero3': {reason}" in printed
