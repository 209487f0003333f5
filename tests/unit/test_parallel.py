"""The pure parts beyond data parallelism: config refusals by field, the forms (tensor parallelism, the bubble, a
pipeline step, memory per GPU), the planner's layouts, the bubble measured on hand-made events, TP collectives
against the form, and the single-process check, including a planted summing bug (what FSDP2 on gloo was reported
to do, github.com/pytorch/pytorch/issues/162338) that it must name."""

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from dtlab.config.parallel import layout, split_layers
from dtlab.config.run import RunConfig, tiny
from dtlab.model import parallel as mp
from dtlab.model import planner as pl
from dtlab.model.link import Link
from dtlab.results import pipeline, reference
from dtlab.results.parallel import tp_collectives


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (dict(microbatches=2), "microbatches 2 applies to strategy 'pp' only, got strategy 'ddp'"),
        (dict(pp_schedule="1f1b"), "pp_schedule '1f1b' applies to strategy 'pp' only"),
        (
            dict(strategy="pp", pp_schedule="zb"),
            "parallel.schedule (pp_schedule) must be one of 'gpipe', '1f1b', got 'zb'",
        ),
        (dict(strategy="pp", microbatches=0), "microbatches must be an integer >= 1, got 0"),
        (dict(strategy="pp", microbatches=3), "microbatches must divide batch_size (4)"),
        (
            dict(strategy="pp", pp_schedule="1f1b"),
            "microbatches must be >= the 2 pipeline stages for pp_schedule '1f1b'",
        ),
        (dict(strategy="pp", nproc=4), "must be at most tiny's 2 layers"),
        (dict(strategy="tp", nproc=4), "must divide tiny's n_heads (2)"),
        (dict(strategy="tp", nproc=4, dp_degree=3), "dp_degree must divide the 4 ranks"),
        (dict(strategy="tp", dp_degree=2), "needs at least 2 ranks per replica"),
        (dict(strategy="fsdp2", dp_degree=2), "dp_degree 2 applies to strategy 'tp' or 'pp' only"),
        (dict(reference=True, dropout=0.0), "reference True applies to strategy 'fsdp2' or 'tp' or 'pp' only"),
        (dict(strategy="tp", reference=True), "reference needs dropout 0"),
        (dict(dropout=1.0), "dropout must be None (the model's own) or a number in [0, 1), got 1.0"),
        (dict(dropout=True), "dropout must be None"),
    ],
)
def test_bad_layouts_are_refused_by_field(overrides, needle):
    with pytest.raises(ValueError) as e:
        tiny(**overrides).validate(cuda_device_count=0)
    assert needle in str(e.value)


def test_good_layouts_and_their_degrees():
    assert layout(tiny(strategy="tp", nproc=4, dp_degree=2).validate(0)) == {"dp": 2, "tp": 2, "pp": 1}
    assert layout(tiny(strategy="pp", nproc=4, dp_degree=2, microbatches=4, pp_schedule="1f1b").validate(0)) == {
        "dp": 2,
        "tp": 1,
        "pp": 2,
    }
    assert layout(tiny(strategy="fsdp2", nproc=2).validate(0)) == {"dp": 2, "tp": 1, "pp": 1}
    assert layout(tiny(nproc=2).validate(0)) == {"dp": 2, "tp": 1, "pp": 1}
    cfg = tiny(model="distilbert", strategy="tp", nproc=4, reference=True, dropout=0.0).validate(0)
    assert layout(cfg)["tp"] == 4  # 12 heads and 3072 columns split 4 ways


def test_split_layers_gives_extra_blocks_to_the_last_stages():
    assert split_layers(6, 2) == [(0, 3), (3, 6)]
    assert split_layers(6, 4) == [(0, 1), (1, 2), (2, 4), (4, 6)]
    assert split_layers(2, 2) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="stages must be between 1 and the 2 layers"):
        split_layers(2, 3)


def test_tensor_parallel_form():
    assert mp.tp_allreduces(6) == 24
    assert mp.tp_allreduce_bytes(8, 128, 768) == 8 * 128 * 768 * 4
    assert mp.tp_step_comm(Link(alpha=1e-5, beta=1e-9), 8, 128, 768, 6, 1) == 0.0  # one rank: nothing to reduce
    one = mp.tp_step_comm(Link(alpha=1e-5, beta=0.0), 8, 128, 768, 6, 2)
    assert one == pytest.approx(24 * 2 * 1e-5)  # 24 all-reduces, 2(p-1) latency steps each


def test_fsdp2_step_comm_on_a_link():
    # ring, p = 4, 1e6 parameter bytes of which 2e5 in the root unit, alpha 10 us, beta 1 ns/B: each collective
    # (p-1) alpha + (p-1)/p n beta: gathers 3e-5 + 7.5e-4 (forward) and 3e-5 + 6e-4 (backward, the root kept),
    # reduce-scatter 3e-5 + 7.5e-4
    d = mp.fsdp2_step_comm(Link(alpha=1e-5, beta=1e-9), 1e6, 2e5, 4)
    assert d["all_gather_fwd"] == pytest.approx(7.8e-4) and d["all_gather_bwd"] == pytest.approx(6.3e-4)
    assert d["reduce_scatter"] == pytest.approx(7.8e-4) and d["total"] == pytest.approx(7.8e-4 * 2 + 6.3e-4)


def test_bubble_and_pipeline_step():
    assert mp.bubble_fraction(2, 1) == 0.5 and mp.bubble_fraction(2, 4) == pytest.approx(0.2)
    assert mp.bubble_fraction(4, 8) == pytest.approx(3 / 11) and mp.bubble_fraction(1, 8) == 0
    with pytest.raises(ValueError, match="integers >= 1"):
        mp.bubble_fraction(0, 4)
    s = mp.pipeline_step(0.01, 4, 8)
    assert s["t_pipe"] == pytest.approx(11 * 0.01) and s["bubble_s"] == pytest.approx(3 * 0.01)
    assert 1 - s["busy"] / s["t_pipe"] == pytest.approx(s["bubble"])
    assert mp.in_flight("gpipe", 4, 8) == 8 and mp.in_flight("1f1b", 4, 8) == 4 and mp.in_flight("1f1b", 4, 2) == 2


def test_memory_per_gpu_of_a_layout():
    arch = pl.MODELS["distilbert"]
    one = mp.layout_memory(arch, 8, 128, 1, 1, 1)
    assert one["params"] == pl.total_params(arch) == 66_955_010
    assert one["states"] == 16 * one["params"]
    tp2 = mp.layout_memory(arch, 8, 128, 1, 2, 1)
    assert tp2["params"] < one["params"] and tp2["activations"] < one["activations"]
    sharded = mp.layout_memory(arch, 8, 128, 4, 1, 1, sharded=True)
    assert sharded["states"] == pytest.approx(one["states"] / 4)
    gpipe, f1b = (mp.layout_memory(arch, 8, 128, 1, 1, 2, 8, s) for s in ("gpipe", "1f1b"))
    assert gpipe["activations"] == pytest.approx(4 * f1b["activations"])  # 8 micro-batches held against 2


LEVELS = {"alpha_intra": 5e-6, "beta_intra": 1e-11, "alpha_inter": 3e-5, "beta_inter": 1e-10, "source": "test"}
COMPUTE = {
    "t_fb_per_sample": 0.01,
    "t_opt": 0.05,
    "seq": 128,
    "params": 66_955_010,
    "nonembedding_params": pl.nonembedding_params(pl.MODELS["distilbert"]),
    "source": "test",
}


def test_planner_layouts_and_levels():
    assert sorted(pl.layouts(4, pl.MODELS["tiny"])) == [(1, 2, 2), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    assert all(a * b * c == 64 for a, b, c in pl.layouts(64, pl.MODELS["gpt3-6.7b"]))
    t = pl.plan(
        pl.MODELS["gpt3-1.3b"],
        16,
        gpus_per_node=8,
        gpu_memory=800e9,
        global_batch=64,
        seq=128,
        microbatches=4,
        levels=LEVELS,
        compute=COMPUTE,
    )
    assert set(t["layout"]) == {
        f"{d}x{a}x{b}" for d, a, b in pl.layouts(16, pl.MODELS["gpt3-1.3b"]) if (64 // d) % 4 == 0 and 64 % d == 0
    }
    assert t["fits"].all() and (t["t_step"].diff().dropna() >= 0).all()
    row = t.set_index("layout")
    assert row.loc["1x16x1", "tp_level"] == "both levels" and row.loc["2x8x1", "tp_level"] == "intra-node"
    assert row.loc["16x1x1", "dp_level"] == "both levels" and row.loc["2x8x1", "dp_level"] == "inter-node"
    assert row.loc["16x1x1", "tp_comm"] == 0 and row.loc["16x1x1", "bubble"] == 0
    parts = row[["compute", "tp_comm", "p2p", "bubble", "dp_comm", "optimizer"]].sum(axis=1)
    assert np.allclose(parts, row["t_step"])
    small = pl.plan(
        pl.MODELS["gpt3-175b"],
        8,
        gpus_per_node=8,
        gpu_memory=80e9,
        global_batch=8,
        seq=2048,
        levels=LEVELS,
        compute=COMPUTE,
    )
    assert not small["fits"].any()  # 175 B parameters x 16 B do not fit on 8 GPUs of 80 GB


def _pipeline_run(spans, t_pipe, m=4, warmup=0):
    """A fake run: spans = {stage: [(phase, mb, start, end), ...]} of one step, repeated for 2 steps."""
    mb, st = [], []
    for step in range(2):
        for stage, rows in spans.items():
            mb += [
                dict(rank=stage, step=step, stage=stage, microbatch=i, phase=ph, t_start=a, t_end=b)
                for ph, i, a, b in rows
            ]
            st.append(dict(rank=stage, step=step, stage=stage, dp_rank=0, t_pipe=t_pipe[stage]))
    return SimpleNamespace(
        path="fake",
        warmup=warmup,
        config=RunConfig(parallel={"microbatches": m, "schedule": "gpipe"}),
        steps=pd.DataFrame(st),
        microbatches=pd.DataFrame(mb),
    )


def test_measured_bubble_of_an_ideal_gpipe_step_is_the_theory():
    # 2 stages, 4 micro-batches, forward 1, backward 2 on each stage, transfers free
    s0 = [("forward", i, i, i + 1) for i in range(4)] + [("backward", i, 7 + 2 * i, 9 + 2 * i) for i in range(4)]
    s1 = [("forward", i, i + 1, i + 2) for i in range(4)] + [("backward", i, 5 + 2 * i, 7 + 2 * i) for i in range(4)]
    b = pipeline.bubble(_pipeline_run({0: s0, 1: s1}, {0: 15.0, 1: 13.0}))
    assert b.measured == pytest.approx(0.2) and b.theory == pytest.approx(0.2) and b.unequal == pytest.approx(0.2)
    held = pipeline.in_flight(_pipeline_run({0: s0, 1: s1}, {0: 15.0, 1: 13.0}))
    assert held["in_flight"].tolist() == [4, 4]


def test_a_pipeline_that_does_not_overlap_its_stages_is_caught():
    # stage 1 starts only when stage 0 finished every forward: no overlap, the bubble stays at 0.5 whatever M
    s0 = [("forward", i, i, i + 1) for i in range(4)] + [("backward", i, 16 + 2 * i, 18 + 2 * i) for i in range(4)]
    s1 = [("forward", i, 4 + i, 5 + i) for i in range(4)] + [("backward", i, 8 + 2 * i, 10 + 2 * i) for i in range(4)]
    b = pipeline.bubble(_pipeline_run({0: s0, 1: s1}, {0: 24.0, 1: 16.0}))
    assert b.measured == pytest.approx(0.5) and abs(b.measured - b.theory) > 0.2


def test_tp_collectives_against_the_form():
    rows = [
        dict(rank=0, step=0, op="all_reduce", axis="tp", phase=ph, nbytes=4 * 32 * 32 * 4, layer=layer, sublayer=s)
        for ph in ("forward", "backward")
        for layer in (0, 1)
        for s in ("attention", "ffn")
    ]
    run = SimpleNamespace(
        path="fake",
        collectives=pd.DataFrame(rows),
        resolved={"n_layers": 2, "hidden": 32},
        config=RunConfig(batch_size=4, seq_len=32),
    )
    t = tp_collectives(run)
    assert t["matches"].all() and t.loc[0, "count"] == 8 == t.loc[0, "form_count"]
    run.collectives = pd.DataFrame(rows[:-1] + [dict(rows[-1], nbytes=1)])
    assert not tp_collectives(run)["matches"].any()
    run.collectives = pd.DataFrame(rows + rows[:2])  # the naive plan's extra backward all-reduces
    assert not tp_collectives(run)["matches"].any()


def _grads(world: int, summed: bool):
    """Gradients of a small model: one process on the whole batch, and `world` ranks on equal shards whose
    gradients are averaged, or summed (the planted bug)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    x, y = torch.randn(8, 6), torch.randint(0, 2, (8,))

    def grads(xs, ys):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads(x, y)
    shards = [grads(xs, ys) for xs, ys in zip(x.chunk(world), y.chunk(world))]
    got = [sum(gs) / (1 if summed else world) for gs in zip(*shards)]
    return got, ref


@pytest.mark.parametrize("summed", [False, True])
def test_the_single_process_check_catches_summed_gradients(summed):
    from dtlab.rank.reference import grad_agreement

    got, ref = _grads(2, summed)
    rec = grad_agreement(zip(got, ref))
    assert rec["params_compared"] == 4
    table = pd.DataFrame([{"rank": r, "step": 0, "loss": 0.69, "ref_loss": 0.69, **rec} for r in range(2)])
    agreed, why = reference.agreement(reference.step_table(table), world=2)
    if summed:
        assert rec["grad_ratio"] == pytest.approx(2.0) and agreed == "summed", why
        assert "summed over the ranks instead of averaged" in why and "162338" in why
    else:
        assert rec["grad_ratio"] == pytest.approx(1.0) and rec["grad_rel_err"] < 1e-6 and agreed == "equal", why


def test_the_single_process_check_names_a_loss_or_gradient_that_differs():
    base = {
        "rank": 0,
        "step": 0,
        "loss": 0.69,
        "ref_loss": 0.69,
        "grad_ratio": 1.0,
        "grad_rel_err": 1e-7,
        "grad_max_abs_diff": 0.0,
    }
    ok = reference.agreement(reference.step_table(pd.DataFrame([base])), world=2)
    assert ok[0] == "equal"
    off = reference.agreement(reference.step_table(pd.DataFrame([dict(base, grad_ratio=1.01, grad_rel_err=0.01)])), 2)
    assert off[0] == "differs" and "gradient ratio 1.01" in off[1]
    loss = reference.agreement(reference.step_table(pd.DataFrame([dict(base, loss=0.7)])), world=2)
    assert loss[0] == "differs" and "loss 0.7" in loss[1]
    pipe = pd.DataFrame([dict(base, loss=None), dict(base, rank=1)])  # a pipeline: only the last stage has a loss
    assert reference.step_table(pipe).loc[0, "loss"] == pytest.approx(0.69)


def test_whatif_with_tensor_parallelism():
    from dtlab.model import whatif as wi
    from dtlab.model.link import Link

    sizes = wi.distilbert_param_nbytes()[::-1]
    args = (0.01, 0.02, 0.004, sizes, 25.0, 8, Link(alpha=1e-5, beta=1e-9))
    plain = wi.whatif(*args)
    one = wi.whatif(*args, tp=wi.tp_setting(1, 6, 4096, 768))
    assert one["t_step"] == plain["t_step"] and one["tp_comm"] == plain["tp_comm"] == 0 and one["dp"] == 8
    tp = wi.whatif(*args, tp=wi.tp_setting(2, 6, 4096, 768))
    each = mp.tp_step_comm(Link(alpha=1e-5, beta=1e-9), 4096, 1, 768, 6, 2)  # 24 all-reduces of 4096 x 768 x 4 B
    assert tp["tp_comm"] == pytest.approx(each) and tp["dp"] == 4 and tp["nproc"] == 8
    assert tp["t_fwd"] == pytest.approx(0.005 + each / 2) and tp["t_opt"] == pytest.approx(0.002)
    assert sum(tp["bucket_nbytes"]) == pytest.approx(sum(sizes) / 2, rel=1e-6)
    free = wi.whatif(0.01, 0.02, 0.004, sizes, 25.0, 8, Link(alpha=0.0, beta=0.0), tp=wi.tp_setting(2, 6, 4096, 768))
    assert free["t_step"] == pytest.approx(0.017)  # communication free: the step is compute / t
