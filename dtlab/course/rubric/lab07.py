"""Lab 7 (beyond one machine): the fitted bandwidth of the emulated link, flat ring vs hierarchical for 25 MiB on
2 x 8, a node's network bytes per hierarchical all-reduce as a formula."""

from __future__ import annotations

from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key
from dtlab.launching.emulate import parse_rate
from dtlab.model.hierarchy import (
    flat_ring_allreduce,
    hierarchical_allreduce,
    level_from_profile,
    levels_from_profiles,
    network_bytes_per_node,
)

LAB = "07_beyond_one_machine"
RATE = "1gbit"  # the emulated link's rate
NODES, G = 2, 8  # the cluster the model extrapolates to


def sizes(quick: bool) -> list[int]:
    """The lab's SIZES (bytes)."""
    return [2**k for k in range(18, 25)] if quick else [2**k for k in range(20, 26)]


def sources(rec) -> dict:
    """Both levels' calibrations: 2 ranks inside this machine, and 1 rank per emulated node across 2 nodes."""
    s = sizes(rec.quick)
    return {
        "intra": lambda: rec.calibration(
            {"nproc": 2, "ops": ["all_reduce"], "sizes": s, "nnodes": 1}, "lab 7's calibration inside a node (2 ranks)"
        ),
        "inter": lambda: rec.calibration(
            {"nproc": 1, "sizes": s, "nnodes": 2}, "lab 7's calibration between the 2 emulated nodes"
        ),
    }


def _levels(intra, inter) -> dict:
    return levels_from_profiles(intra, inter)


def _link(inter) -> Key:
    link = inter.meta.get("emulation", {}).get("link", "loopback")
    shaped = link != "loopback" and "shaped" in link
    want = 1 / level_from_profile(inter)[1] / 1e6 if shaped else parse_rate(RATE) / 1e6
    return Key(
        "lab07.q1",
        "number",
        want,
        points=2,
        rel_tol=0.15,
        unit="MB/s",
        tol_source=(
            "15%: the acceptance bound of dtlab's shaped-link benchmark (TCP/IP headers take ~4%, the "
            "fit and the shared cores the rest)"
        )
        if shaped
        else "no shaped link on this machine: checked against the rate set on the link, not a measurement",
        hint="1 Gbit/s is 10^9 bits per second; 8 bits per byte; MB is 10^6 bytes",
    )


def _faster(intra, inter) -> Key:
    lv = _levels(intra, inter)
    args = (lv["alpha_intra"], lv["beta_intra"], lv["alpha_inter"], lv["beta_inter"], 25 * 2**20, NODES, G)
    t_flat, t_hier = float(flat_ring_allreduce(*args)), float(hierarchical_allreduce(*args))
    return Key(
        "lab07.q2",
        "choice",
        "flat" if t_flat < t_hier else "hierarchical",
        choices=("flat", "hierarchical"),
        explanation=f"two-level model with the calibrated levels: flat {t_flat * 1e3:.1f} ms, hierarchical "
        f"{t_hier * 1e3:.1f} ms for 25 MiB on {NODES} x {G}",
        hint="price both with the two levels printed above (the figure shows both curves)",
    )


def node_bytes(N, n):
    """A node's network bytes per hierarchical all-reduce of n bytes on N nodes of G GPUs (dtlab.model.hierarchy)."""
    return network_bytes_per_node("hierarchical", n, N, G)


def _node_formula(*_) -> Key:
    return Key(
        "lab07.q3",
        "formula",
        node_bytes,
        points=2,
        variables=("N", "n"),
        grid={"N": [2, 3, 4, 16], "n": [1, 1000, 2**25]},
        explanation="dtlab.model.hierarchy's network_bytes_per_node",
        tol_source="exact formula, compared at every point of a grid",
        hint="g rings, one per local rank, each all-reduce an n/g shard across N nodes",
    )


QUESTIONS = (
    Question("lab07.q1", 2, "my_link_mbps", ("inter",), _link),
    Question("lab07.q2", 1, "my_faster", ("intra", "inter"), _faster),
    Question("lab07.q3", 2, "my_node_bytes", (), _node_formula),
)
