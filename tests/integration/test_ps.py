"""Strategy 'ps' (reduce to rank 0 + broadcast, dtlab.rank.strategies.ps) against DDP's ring all-reduce: the same
training, bytes conserved, the transport's arithmetic and order on 2 and 3 gloo ranks, and the measured
shapes in n and p."""

import json
import os
import time

import numpy as np
import pytest

import dtlab

# ---- real training: the same losses as DDP, every byte reduced once ----------------------------------------


def test_ps_trains_like_ddp_and_conserves_bytes(tiny_run, tmp_path):
    # the same config as the session's DDP run (conftest.tiny_run), through the sweep's strategy axis
    base = dtlab.tiny(steps=4, baseline_steps=2, bucket_mb=0.05)
    df = dtlab.sweep(base, strategy=["ps"], nproc=[2], bucket_mb=[0.05], out=str(tmp_path / "sw"), progress=False)
    assert list(df["status"]) == ["ran"] and list(df["strategy"]) == ["ps"]
    assert not df["oversubscribed"].iloc[0]  # 2 ranks on this 2-core CI machine
    ps, ddp = dtlab.load_run(df["path"].iloc[0]), tiny_run
    assert ps.config.strategy == "ps" and ddp.config.strategy == "ddp"
    # Both average the same gradients, so every rank's loss at every step is the same (a missing broadcast
    # leaves rank 1 with partial sums and its losses drift from step 1 on)
    m = ddp.steps.merge(ps.steps, on=["rank", "step"], suffixes=("_ddp", "_ps"))
    assert len(m) == 2 * base.steps
    np.testing.assert_allclose(m["loss_ps"], m["loss_ddp"], rtol=1e-6, atol=0)
    # Conservation: every rank's buckets carry the gradient bytes once per step, in DDP's own layout
    g = ps.resolved["grad_bytes"]
    per = ps.buckets.groupby(["rank", "step"])[["nbytes", "server_bytes", "wire_bytes"]].sum()
    assert len(per) == 2 * base.steps and (per["nbytes"] == g).all() and (per["wire_bytes"] == g).all()
    assert (per["server_bytes"] == 2 * (2 - 1) * g).all()
    assert (ps.buckets.groupby(["rank", "step"]).size() == ddp.buckets.groupby(["rank", "step"]).size()).all()
    b = ps.buckets
    assert (b["t_ready"] <= b["t_start"]).all() and (b["t_start"] <= b["t_reduced"]).all()
    assert (b["t_reduced"] <= b["t_end"]).all()
    s = ps.summary().set_index("quantity")
    assert s.loc["T_comp", "how"].startswith("measured") and s.loc["T_comm", "value"] > 0
    trace = ps.to_chrome_trace()
    assert any(e.get("name", "").startswith("reduce+broadcast bucket") for e in trace["traceEvents"])


# ---- measured shapes: ring all-reduce vs reduce + broadcast on gloo, p = 2 and 4 in one launch -------------


def test_measured_ps_and_ring_follow_their_shapes_in_n_and_p(tmp_path):
    """One launch of 4 ranks times both ops on the first 2 ranks and on all 4, interleaved, so the machine's
    load is shared by every point. p = 4 oversubscribes 2 cores (flagged). Asserted only what every form and
    this machine agree on, with wide margins (docs/parameter-server.md)."""
    mib = 2**20
    prof = dtlab.calibrate(
        nproc=4,
        group_sizes=(2, 4),
        ops=("all_reduce", "ps"),
        sizes=[4 * mib, 16 * mib, 64 * mib],
        iters=4,
        rounds=2,
        warmup=1,
        out=str(tmp_path / "cal"),
        progress=False,
    )
    s = prof.samples
    assert set(s["nproc"]) == {2, 4} and set(s["op"]) == {"all_reduce", "ps"}
    if prof.meta.get("cpu_cores", 99) < 4:
        assert any("p = 4" in c and "oversubscribed" in c for c in prof.caveats)
    # the fastest of the repeats: other work on the machine only ever adds time, so the minimum is the estimate of
    # each op's own cost that a busy machine (CI running other suites beside this one) disturbs least
    fastest = s.groupby(["op", "nproc", "nbytes"])["seconds"].min()
    small, big = sorted(s["nbytes"].unique())[0], sorted(s["nbytes"].unique())[-1]
    from dtlab.model.fit import fit_alpha_beta

    for op in ("all_reduce", "ps"):
        for p in (2, 4):
            # in n: 16x the bytes costs well over 4x the time (bandwidth-bound), and the fitted beta is positive
            assert fastest[(op, p, big)] > 4 * fastest[(op, p, small)], (op, p)
            assert fit_alpha_beta(s[s["nproc"] == p], op, "ring").beta > 0
        # in p: neither gets cheaper with more ranks (the textbook ring's beta n / p would halve it at p = 4)
        assert fastest[(op, 4, big)] > fastest[(op, 2, big)], op
    # p = 2, not oversubscribed: every form says PS -> 2x the ring at large n, and even a CPU so loaded that
    # every copy is serialised gives the bytes-moved ratio 1.25 (docs/parameter-server.md). Measured 1.6-2.4 on this
    # machine, 1.1 with 2-4 extra busy loops on its 2 cores (medians): asserted is only that the ring wins, at 16 and
    # 64 MiB together
    two = sorted(s["nbytes"].unique())[-2:]
    assert sum(fastest[("ps", 2, n)] for n in two) > sum(fastest[("all_reduce", 2, n)] for n in two)


def _transport_rank(rank, world, store, out, sizes):
    import torch
    import torch.distributed as dist

    from dtlab.rank.strategies.ps import OrderedThreadPS

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ps = OrderedThreadPS(world, torch.device("cpu"))
    issued = []
    for k, n in enumerate(sizes):  # issued at once, as DDP's hook issues buckets; the thread keeps the order
        buf = torch.full((n,), float((rank + 1) * (k + 1))) / world  # divided by p, as the recorder does
        rec = {"nbytes": n * 4, "_ready": time.perf_counter()}
        issued.append((rec, *ps.issue(buf, rec, time.perf_counter)))
    got = []
    for rec, fut, value in issued:
        fut.wait()
        v = value(fut)
        got.append(
            {
                "min": float(v.min()),
                "max": float(v.max()),
                "server_bytes": rec["server_bytes"],
                "ordered": rec["_ready"] <= rec["_start"] <= rec["_t_reduced"] <= rec["_end"],
            }
        )
    ps.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


@pytest.mark.parametrize("world", [3])  # p = 2 is the training test below
def test_reduce_broadcast_averages_every_bucket_on_every_rank(tmp_path, world):
    import torch.multiprocessing as mp

    sizes = [3, 100_000, 7, 1 << 18, 1000, 50_000]  # mixed sizes: a later small bucket must not overtake
    mp.spawn(_transport_rank, args=(world, str(tmp_path / "store"), str(tmp_path), sizes), nprocs=world)
    for rank in range(world):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        for k, (g, n) in enumerate(zip(got, sizes)):
            mean = (k + 1) * (world + 1) / 2  # mean over ranks of (rank + 1)(k + 1)
            assert g["min"] == pytest.approx(mean, rel=1e-6) and g["max"] == pytest.approx(mean, rel=1e-6), (rank, k)
            assert g["server_bytes"] == 2 * (world - 1) * n * 4 and g["ordered"]
