"""The communication levers on the tiny model with 2 gloo ranks: compression through torch's own DDP hooks
(bytes on the wire recorded per bucket) and gradient accumulation; bad combinations refused before launch."""

import types

import pytest

import dtlab
from dtlab.config.compression import wire_factor
from dtlab.config.run import tiny
from dtlab.model.compression import (
    comm_per_sample,
    compression_from_run,
    loss_beside,
    powersgd_wire_numel,
)


def _with_config(run, **changes):
    """A shallow copy of a loaded run whose config differs (to test refusals without another run)."""
    other = types.SimpleNamespace(**vars(run))
    other.config = run.config.replace(**changes)
    return other


def _per_step(run):
    return run.buckets.groupby(["rank", "step"])[["nbytes", "wire_bytes"]].sum()


def test_fp16_halves_the_bytes_on_the_wire_exactly(tmp_path):
    run = dtlab.run(tiny(comm_hook="fp16", steps=3, out=str(tmp_path / "fp16")), progress=False)
    b = run.buckets
    assert len(b) and (b["wire_bytes"] * 2 == b["nbytes"]).all()
    assert (_per_step(run)["nbytes"] == run.resolved["grad_bytes"]).all()  # every gradient still reduced once
    assert wire_factor("fp16") == 0.5 and run.steps["loss"].notna().all()
    # the cost model's r is the measured one, and the encode time was really measured (not zero, not absurd)
    comp = compression_from_run(run)
    assert comp["ratio"] == 0.5 and comp["grad_bytes"] == run.resolved["grad_bytes"] and comp["hook"] == "fp16"
    assert 0 < comp["encode_s"] < run.steps["t_step"].max()
    # the loss beside an uncompressed run with the same seed: step 0 is computed before any update, so it is
    # identical; later steps differ only by fp16 rounding of the averaged gradients
    ref = dtlab.run(tiny(steps=3, out=str(tmp_path / "none")), progress=False)
    side = loss_beside(run, ref)
    assert list(side["step"]) == [0, 1, 2] and side.loc[0, "diff"] == 0.0
    assert side["rel_diff"].abs().max() < 0.05
    with pytest.raises(ValueError, match="seed"):
        loss_beside(run, _with_config(ref, seed=1))


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

    # small buckets: several PowerSGD chains in flight, which deadlocked on gloo before the Codec serialized them
    cfg = tiny(
        comm_hook="powersgd",
        powersgd_rank=2,
        powersgd_start_iter=2,
        steps=4,
        bucket_mb=0.05,
        stall_s=60,
        out=str(tmp_path / "psgd"),
    )
    run = dtlab.run(cfg, progress=False)
    shapes = [tuple(p.shape) for p in build_model("tiny", "random", None, 0).model.parameters() if p.requires_grad]
    expected = _powersgd_numel(shapes, 2) * 4  # fp32 P and Q
    per = _per_step(run).reset_index()
    plain, compressed = per[per.step < 2], per[per.step >= 2]
    assert (plain["wire_bytes"] == run.resolved["grad_bytes"]).all()  # plain all-reduce before start_iter
    assert (compressed["wire_bytes"] == expected).all(), (compressed, expected)
    assert expected * 10 < run.resolved["grad_bytes"]  # rank 2 on these shapes: more than 10x fewer bytes
    assert run.buckets.groupby(["rank", "step"]).size().max() > 1  # really several buckets per step
    assert powersgd_wire_numel(shapes, 2) * 4 == expected  # the package's formula is the test's oracle's
    assert compression_from_run(run)["ratio"] == pytest.approx(expected / run.resolved["grad_bytes"], rel=1e-12)


def test_accumulate_communicates_once_per_k_micro_batches(tmp_path):
    one = dtlab.run(tiny(steps=3, out=str(tmp_path / "k1")), progress=False)
    four = dtlab.run(tiny(steps=3, accumulate=4, out=str(tmp_path / "k4")), progress=False)
    assert (four.steps["micro_batches"] == 4).all() and (one.steps["micro_batches"] == 1).all()
    # the same all-reduce rounds per optimizer step, so one round per 4 micro-batches
    assert (one.buckets.groupby(["rank", "step"]).size() == four.buckets.groupby(["rank", "step"]).size()).all()
    assert (_per_step(four)["nbytes"] == four.resolved["grad_bytes"]).all()
    c1, c4 = comm_per_sample(one), comm_per_sample(four)
    assert c4["samples_per_step"] == 4 * c1["samples_per_step"]
    assert c4["rounds_per_micro_batch"] * 4 == pytest.approx(c1["rounds_per_micro_batch"])
