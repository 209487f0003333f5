"""Issue 12's first levers on the tiny model with 2 gloo ranks: compression through torch's own DDP hooks
(bytes on the wire recorded per bucket) and gradient accumulation; bad combinations refused before launch."""

import types

import pytest

import dtlab
from dtlab.config import tiny
from dtlab.levers import validate_levers, wire_factor


def _per_step(run):
    return run.buckets.groupby(["rank", "step"])[["nbytes", "wire_bytes"]].sum()


def test_fp16_halves_the_bytes_on_the_wire_exactly(tmp_path):
    run = dtlab.run(tiny(comm_hook="fp16", steps=3, out=str(tmp_path / "fp16")), progress=False)
    b = run.buckets
    assert len(b) and (b["wire_bytes"] * 2 == b["nbytes"]).all()
    assert (_per_step(run)["nbytes"] == run.resolved["grad_bytes"]).all()  # every gradient still reduced once
    assert wire_factor("fp16") == 0.5 and run.steps["loss"].notna().all()


def _powersgd_numel(shapes, r, min_rate=2):
    """What torch's PowerSGD sends for these gradient shapes: (n + m) r' per matrix worth compressing (r' =
    min(n, m, r), compressed when (n + m) r' x min_rate < n m), numel otherwise."""
    total = 0
    for shape in shapes:
        n = shape[0]
        m = 1
        for d in shape[1:]:
            m *= d
        rr = min(n, m, r)
        total += (n + m) * rr if (n + m) * rr * min_rate < n * m else n * m
    return total


def test_powersgd_sends_what_its_rank_implies(tmp_path):
    from dtlab.rank.data import build_model
    cfg = tiny(comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=2, steps=4, out=str(tmp_path / "psgd"))
    run = dtlab.run(cfg, progress=False)
    shapes = [tuple(p.shape) for p in build_model("tiny", "random", None, 0).model.parameters() if p.requires_grad]
    expected = _powersgd_numel(shapes, 2) * 4  # fp32 P and Q
    per = _per_step(run).reset_index()
    plain, compressed = per[per.step < 2], per[per.step >= 2]
    assert (plain["wire_bytes"] == run.resolved["grad_bytes"]).all()  # plain all-reduce before start_iter
    assert (compressed["wire_bytes"] == expected).all(), (compressed, expected)
    assert expected * 10 < run.resolved["grad_bytes"]  # rank 2 on these shapes: more than 10x fewer bytes


def test_accumulate_communicates_once_per_k_micro_batches(tmp_path):
    one = dtlab.run(tiny(steps=3, out=str(tmp_path / "k1")), progress=False)
    four = dtlab.run(tiny(steps=3, accumulate=4, out=str(tmp_path / "k4")), progress=False)
    assert (four.steps["micro_batches"] == 4).all() and (one.steps["micro_batches"] == 1).all()
    # the same all-reduce rounds per optimizer step, so one round per 4 micro-batches
    assert (one.buckets.groupby(["rank", "step"]).size() == four.buckets.groupby(["rank", "step"]).size()).all()
    assert (_per_step(four)["nbytes"] == four.resolved["grad_bytes"]).all()


@pytest.mark.parametrize("changes, field", [
    (dict(comm_hook="int8"), "comm_hook"), (dict(accumulate=0), "accumulate"),
    (dict(powersgd_rank=0), "powersgd_rank"), (dict(powersgd_start_iter=1), "powersgd_start_iter"),
    (dict(comm_hook="powersgd", strategy="zero3"), "comm_hook 'powersgd' applies to strategy 'ddp'"),
    (dict(accumulate=2, strategy="zero3"), "accumulate applies to strategy 'ddp'"),
    (dict(comm_hook="fp16", record=False), "needs record=True")])
def test_bad_levers_are_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=field):
        tiny(**changes).validate(cuda_device_count=0)


def test_bf16_refused_for_gloo_on_cuda_tensors():
    cfg = tiny(comm_hook="bf16")
    validate_levers(cfg, types.SimpleNamespace(backend="gloo", device="cpu"))
    validate_levers(cfg, types.SimpleNamespace(backend="nccl", device="cuda"))
    with pytest.raises(ValueError, match="bf16"):
        validate_levers(cfg, types.SimpleNamespace(backend="gloo", device="cuda"))
