"""Strategy 'ps' (reduce to rank 0 + broadcast, dtlab.rank.strategies.ps) against DDP's ring all-reduce: the same
training, bytes conserved, the transport's arithmetic and order on 2 and 3 gloo ranks, and the measured shapes in n and
p."""

import json
import os
import time

import numpy as np
import pandas as pd
import pytest

import dtlab
from dtlab.model import costmodel as cm
from dtlab.model import ps as psmodel
from dtlab.model.link import Link, TwoLevelLink

# ---- the transport alone: 2 and 3 real gloo ranks, many buckets issued back to back -------------------------


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


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(strategy="ps", comm_hook="fp16"), "comm_hook 'fp16' applies to strategy 'ddp' only"),
        (dict(strategy="ps", accumulate=2), "accumulate 2 applies to strategy 'ddp' only"),
        (dict(strategy="ps", record=False), "strategy 'ps' needs record=True"),
        (dict(strategy="pserver"), "strategy must be one of"),
    ],
)
def test_ps_bad_combinations_refused_by_name(changes, needle):
    with pytest.raises(ValueError, match=needle):
        dtlab.tiny(**changes).validate(cuda_device_count=0)
    ps = dtlab.tiny(strategy="ps").validate(cuda_device_count=0)
    assert ps.measurement.baseline_steps == 3  # the no-op baseline works


def test_calibration_group_sizes_checked_and_sizes_rounded_for_every_group():
    from dtlab.config.calibration import CalibConfig

    for bad in ((2, 5), (1, 2), ("two",), ()):
        with pytest.raises(ValueError, match="group_sizes must be"):
            CalibConfig(nproc=4, group_sizes=bad).validate(cuda_device_count=0)
    cfg = CalibConfig(nproc=4, group_sizes="3,2,4", ops="all_reduce,ps", sizes=(2**20,))
    assert cfg.ranks_timed() == [2, 3, 4] and cfg.ops == ("all_reduce", "ps")
    assert cfg.rounded_sizes() == [2**20 + 32]  # a multiple of 4 B x lcm(2, 3, 4): whole fp32 shares for p = 3


# ---- the cost model's forms (pure) --------------------------------------------------------------------------


def test_ps_forms_per_worker_and_at_the_server():
    a, b, n = 1e-5, 1e-9, 1e8
    for p in (2, 4, 16):
        assert cm.parameter_server(a, b, n, p) == pytest.approx(a + b * n)  # per worker: flat in p
        assert cm.ps_server(a, b, n, p) == pytest.approx(2 * a + 2 * (p - 1) * n * b)  # at the server: grows
        # in both families the bandwidth term is p times the same family's all-reduce term
        assert cm.parameter_server(0, b, n, p) / cm.textbook_allreduce(0, b, n, p) == pytest.approx(p)
        assert cm.ps_server(0, b, n, p) / cm.ring_allreduce(0, b, n, p) == pytest.approx(p)
    t = psmodel.forms_table(Link(alpha=0.0, beta=b), n, [2, 3, 4, 8])
    # gloo: ring reduce-scatter + gather + binomial broadcast; (2(p-1)/p + ceil(log2 p)) / (2(p-1)/p)
    assert np.allclose(t["ps_over_ring_gloo"], [2.0, 2.5, 1 + 2 / 1.5, 1 + 3 / 1.75])
    assert np.allclose(t["ps_over_ring_nccl"], [2.0, 1.5, 4 / 3, 8 / 7])  # pipelined rings: p / (p-1)
    assert cm.ps_server(a, b, n, 1) == 0.0 and psmodel.ps_gloo(Link(alpha=a, beta=b), n, 1) == 0.0
    assert cm.busbw("ps", n, cm.ps_server(0.0, b, n, 4), 4) == pytest.approx(1 / b)
    # the implementations' forms price one link: (p + L) alpha + (2(p-1)/p + L) n beta, 2(p-1) alpha + 2 n beta
    link = Link(alpha=a, beta=b)
    assert psmodel.ps_gloo(link, n, 4) == pytest.approx(6 * a + (1.5 + 2) * n * b)
    assert psmodel.ps_nccl(link, n, 4) == pytest.approx(6 * a + 2 * n * b)
    assert t["ring all-reduce"].iloc[0] == pytest.approx(link.time("all_reduce", n, 2) - 2 * a)  # alpha 0 in t


def test_ps_forms_take_one_level_and_name_the_field():
    link = Link(alpha=1e-5, beta=1e-9)
    two = TwoLevelLink(intra=link, inter=link, gpus_per_node=4)
    with pytest.raises(ValueError, match=r"^link must be one level .* TwoLevelLink"):
        psmodel.forms_table(two, 1e6, [2, 4])
    with pytest.raises(ValueError, match=r"^link must be a Link .* got float"):
        psmodel.ps_nccl(1e-5, 1e6, 4)


def test_ps_figures_mark_oversubscribed_points():
    from dtlab.viz.ps import ps_shapes_figure, ps_vs_ring_figure

    df = pd.DataFrame(
        [
            {
                "strategy": st,
                "nproc": p,
                "bucket_mb": 1.0,
                "t_step": 0.1 * p,
                "t_comm": 0.05 * p,
                "oversubscribed": p > 2,
                "status": "ran",
            }
            for st in ("ddp", "ps")
            for p in (2, 3)
        ]
    )
    fig = ps_vs_ring_figure(df)
    assert len(fig.data) == 4  # 2 strategies x (T_step, T_comm)
    assert all(list(t.marker.symbol) == ["circle", "circle-open"] for t in fig.data)
    assert "oversubscribed" in json.dumps(fig.to_plotly_json()["layout"]["annotations"])
    s = pd.DataFrame(
        [
            {"op": op, "nproc": p, "nbytes": n, "seconds": n * 1e-9 * (2 if op == "ps" else 1)}
            for op in ("all_reduce", "ps")
            for p in (2, 3)
            for n in (2**20, 2**24)
        ]
    )
    fig = ps_shapes_figure(s, cpu_cores=2)
    measured = [t for t in fig.data if t.name.startswith("measured")]
    assert len(measured) == 2 and all(np.allclose(t.y, 2.0) for t in measured)  # the PS / ring ratio
    assert any("(oversubscribed)" in t.name for t in fig.data)
    with pytest.raises(ValueError, match="both ops"):
        ps_shapes_figure(s[s["op"] == "ps"])
    with pytest.raises(ValueError, match="sweep table"):
        ps_vs_ring_figure(df.drop(columns=["strategy"]))
