"""The two-level model reduces to the single-level ring where it must, and hierarchy wins or loses where the
forms say it should."""

import dataclasses

import numpy as np
import pytest

from dtlab.model import costmodel as cm
from dtlab.model.hierarchy import (
    crossover_bytes,
    flat_ring_allreduce,
    hierarchical_allreduce,
    network_bytes_per_node,
    two_level_time,
)
from dtlab.model.link import Link, TwoLevelLink

A_I, B_I, A_E, B_E = 5e-6, 1 / 100e9, 30e-6, 1 / 12.5e9  # NVLink-ish inside, 100 Gbit/s-ish between nodes


N = np.array([1e3, 1e6, 1e9])


def test_one_node_is_the_single_level_ring():
    for g in (2, 4, 8):
        ring = cm.ring_allreduce(A_I, B_I, N, g)
        assert np.allclose(flat_ring_allreduce(A_I, B_I, A_E, B_E, N, 1, g), ring)
        assert np.allclose(hierarchical_allreduce(A_I, B_I, A_E, B_E, N, 1, g), ring)


def test_one_gpu_per_node_is_the_ring_across_nodes():
    for nodes in (2, 4):
        ring = cm.ring_allreduce(A_E, B_E, N, nodes)
        assert np.allclose(flat_ring_allreduce(A_I, B_I, A_E, B_E, N, nodes, 1), ring)
        assert np.allclose(hierarchical_allreduce(A_I, B_I, A_E, B_E, N, nodes, 1), ring)
    assert np.all(flat_ring_allreduce(A_I, B_I, A_E, B_E, N, 1, 1) == 0)


def test_hierarchy_wins_when_the_network_is_slow_and_by_the_forms_margin():
    flat = flat_ring_allreduce(A_I, B_I, A_E, B_E, N, 2, 8)
    hier = hierarchical_allreduce(A_I, B_I, A_E, B_E, N, 2, 8)
    assert np.all(hier < flat)
    # large n: flat ~ 2(p-1)/p n beta_inter (15/8), hierarchical ~ 2(N-1)/N n beta_inter (1) + intra traffic
    n = 1e9
    assert flat[-1] == pytest.approx(2 * 15 * (A_E + B_E * n / 16))
    assert hier[-1] == pytest.approx(2 * (7 * A_I + 7 / 8 * n * B_I) + 2 * A_E + n * B_E)
    assert network_bytes_per_node("flat", n, 2, 8) == pytest.approx(15 / 8 * n)
    assert network_bytes_per_node("hierarchical", n, 2, 8) == pytest.approx(n)


def test_more_nics_speed_up_only_the_hierarchical_shard_rings():
    one = hierarchical_allreduce(A_I, B_I, A_E, B_E, 1e9, 2, 8, nics_per_node=1)
    eight = hierarchical_allreduce(A_I, B_I, A_E, B_E, 1e9, 2, 8, nics_per_node=8)
    assert eight < one
    assert flat_ring_allreduce(A_I, B_I, A_E, B_E, 1e9, 2, 8, nics_per_node=8) == flat_ring_allreduce(
        A_I, B_I, A_E, B_E, 1e9, 2, 8
    )


def test_crossover_when_both_links_are_equally_fast():
    # equal bandwidth inside and between nodes: hierarchy's fewer network latency steps win small messages;
    # its three phases run one after the other while the flat ring pipelines every edge, so large ones lose
    a_i, b_i, a_e, b_e = 2e-6, 1 / 10e9, 20e-6, 1 / 10e9
    x = crossover_bytes(_two(a_i, b_i, a_e, b_e, 4), 2)
    assert x is not None
    below, above = x / 4, x * 4
    assert two_level_time("hierarchical", a_i, b_i, a_e, b_e, below, 2, 4) < two_level_time(
        "flat", a_i, b_i, a_e, b_e, below, 2, 4
    )
    assert two_level_time("hierarchical", a_i, b_i, a_e, b_e, above, 2, 4) > two_level_time(
        "flat", a_i, b_i, a_e, b_e, above, 2, 4
    )
    assert crossover_bytes(_two(A_I, B_I, A_E, B_E, 8), 2) is None  # fast inside: hierarchy never loses
    with pytest.raises(ValueError, match=r"^link must be a TwoLevelLink"):
        crossover_bytes(Link(alpha=A_I, beta=B_I), 2)


def _two(a_i, b_i, a_e, b_e, gpus_per_node):
    return TwoLevelLink(intra=Link(alpha=a_i, beta=b_i), inter=Link(alpha=a_e, beta=b_e), gpus_per_node=gpus_per_node)


@pytest.mark.parametrize("kw", [dict(nodes=0), dict(gpus_per_node=1.5), dict(nodes=True)])
def test_bad_levels_are_refused(kw):
    args = dict(nodes=2, gpus_per_node=4)
    args.update(kw)
    with pytest.raises(ValueError, match="nodes|gpus_per_node"):
        flat_ring_allreduce(A_I, B_I, A_E, B_E, 1e6, args["nodes"], args["gpus_per_node"])
    with pytest.raises(ValueError, match="algorithm"):
        two_level_time("tree", A_I, B_I, A_E, B_E, 1e6, 2, 2)


# ---------------------------------------------------------------- the two-level explorer
from dtlab.viz.two_level import (  # noqa: E402
    ASSUMED_LEVELS,
    levels_table,
    two_level_explorer,
    two_level_figure,
)

SIZES = [4 * 2**20, 2**20, 3 * 2**20, 512]


COMPUTE = {"t_fwd": 0.01, "t_bwd_comp": 0.002, "t_opt": 0.001}  # little backward to hide behind


def test_levels_table_one_node_is_one_level_and_slow_network_favours_hierarchy():
    one = levels_table(ASSUMED_LEVELS, 1, 8, compute=COMPUTE, param_nbytes=SIZES, bucket_mb=1.0)
    assert one["t_step"].iloc[0] == pytest.approx(one["t_step"].iloc[1])
    assert (one["network_bytes_per_node"] == 0).all()
    two = levels_table(ASSUMED_LEVELS, 4, 8, compute=COMPUTE, param_nbytes=SIZES, bucket_mb=1.0).set_index("algorithm")
    assert two.loc["hierarchical", "t_comm"] < two.loc["flat", "t_comm"]
    assert two.loc["hierarchical", "network_bytes_per_node"] < two.loc["flat", "network_bytes_per_node"]
    with pytest.raises(ValueError, match="beta_inter"):
        levels_table(dict(ASSUMED_LEVELS, beta_inter=-1.0), 2, 2)


def test_two_level_figure_marks_the_crossover_only_when_there_is_one():
    equal = dict(alpha_intra=2e-6, beta_intra=1e-10, alpha_inter=20e-6, beta_inter=1e-10)
    fig = two_level_figure(equal, 2, 4)
    assert len(fig.data) == 2 and any("crossover" in a.text for a in fig.layout.annotations)
    assert not any("crossover" in (a.text or "") for a in two_level_figure(ASSUMED_LEVELS, 2, 8).layout.annotations)


def test_two_level_explorer_sliders_drive_the_table_and_say_where_levels_come_from():
    box = two_level_explorer(compute=COMPUTE, param_nbytes=SIZES)
    assert "assumed, not calibrated" in box.children[0].value and "given by the caller" in box.children[0].value
    assert "placeholder, not measured" in two_level_explorer().children[0].value  # no compute given: said so
    before = box.table.set_index("algorithm")["t_step"].copy()
    box.sliders["nodes"].value = 8
    after = box.table.set_index("algorithm")["t_step"]
    assert (after > before).all()
    assert "8 node(s) x 8 GPU(s) = p 64" in box.figure.layout.title.text


def test_two_level_explorer_hides_only_the_network_controls_with_one_node():
    """One node has no network: its links, inter α and 1/β are hidden, and the node count stays there to go back
    (the sliders shared one Layout, so hiding one hid them all)."""
    box = two_level_explorer(compute=COMPUTE, param_nbytes=SIZES)
    box.sliders["nodes"].value = 1
    hidden = {k for k, w in box.sliders.items() if w.layout.display == "none"}
    assert hidden == {"nics_per_node", "alpha_inter_us", "bw_inter_gbs"}
    box.sliders["nodes"].value = 2
    assert not any(w.layout.display == "none" for w in box.sliders.values())


def test_two_level_explorer_starts_with_a_zero_alpha_without_breaking():
    box = two_level_explorer(
        dict(ASSUMED_LEVELS, alpha_inter=0.0, source="calibrated, alpha clipped to 0"),
        compute=COMPUTE,
        param_nbytes=SIZES,
    )
    assert box.sliders["alpha_inter_us"].value == pytest.approx(0.1) and "clipped" in box.children[0].value


def test_two_level_explorer_takes_a_two_level_link_of_public_outputs():
    from dtlab.results.nccl_profile import public_nccl_tests

    link = TwoLevelLink.from_node_counts(
        public_nccl_tests("aws-p5-1x8-h100-nvswitch"), public_nccl_tests("aws-p5-2x8-h100-efa")
    )
    box = two_level_explorer(link, compute=COMPUTE, param_nbytes=SIZES)
    assert box.sliders["gpus_per_node"].value == link.gpus_per_node == 8
    other = dataclasses.replace(link, gpus_per_node=4, nics_per_node=4)  # not the sliders' defaults (8 and 1)
    moved = two_level_explorer(other, compute=COMPUTE, param_nbytes=SIZES).sliders
    assert (moved["gpus_per_node"].value, moved["nics_per_node"].value) == (4, 4)
    now = box.levels()[0]
    assert (now["alpha_intra"], now["beta_inter"]) == (link.intra.alpha, link.inter.beta)  # not a slider's rounding
    assert "aws-p5-1x8-h100-nvswitch" in box.children[0].value and "intra:" in box.children[0].value
    with pytest.raises(ValueError, match="levels must be a TwoLevelLink"):
        two_level_explorer(link.intra, compute=COMPUTE, param_nbytes=SIZES)
    # a level whose bytes cost nothing (beta 0, which a Link allows) starts at its slider's top, said in the label
    free = link.replace(inter=link.inter.replace(beta=0.0))
    box = two_level_explorer(free, compute=COMPUTE, param_nbytes=SIZES)
    assert box.sliders["bw_inter_gbs"].value == pytest.approx(1000.0) and box.levels()[0]["beta_inter"] == 0.0
    assert "inter β = 0" in box.children[0].value


def test_levels_from_profiles_fall_back_to_an_estimate_when_the_fit_is_unusable():
    import pandas as pd

    from dtlab.model.hierarchy import level_from_profile, levels_from_profiles
    from dtlab.model.profile import Profile

    def prof(alpha, beta):
        sizes = [2**18, 2**20, 2**22]
        rows = [
            {"op": "all_reduce", "nbytes": n, "nproc": 2, "seconds": alpha * 2 + beta * n, "iter": i}
            for n in sizes
            for i in range(3)
        ]
        return Profile.from_samples(pd.DataFrame(rows))

    good = prof(50e-6, 1 / 1e9)
    a, b, how = level_from_profile(good)
    assert a == pytest.approx(50e-6, rel=1e-3) and b == pytest.approx(1e-9, rel=1e-3) and how == "fitted"
    bad = prof(50e-6, 1 / 1e9)
    bad.fits["all_reduce"].beta = -1e-11  # what a short noisy sweep fitted in CI
    a, b, how = level_from_profile(bad)
    n = 2**22
    assert a == 0.0 and b == pytest.approx((100e-6 + n / 1e9) / n) and "estimated" in how
    lv = levels_from_profiles(good, bad)
    assert lv["beta_inter"] > 0 and "between nodes (estimated" in lv["source"]
    two_level_explorer(lv, compute=COMPUTE, param_nbytes=SIZES)  # builds with the estimate
