"""The two-level alpha-beta model: p = nodes x gpus_per_node ranks, an intra-node link (alpha_intra,
beta_intra: NVLink / PCIe / shared memory) and an inter-node link (alpha_inter, beta_inter: the network).

Seconds, seconds per byte, bytes (the full message, nccl-tests convention), as in :mod:`dtlab.model.costmodel`.

Flat ring (one ring over all p ranks, every step in lockstep)
    Of the ring's p edges, `nodes` cross the network (one per node, in and out), the rest stay inside a node.
    Each of the 2(p-1) steps moves n/p bytes over every edge at once, so a step lasts as long as its slowest
    edge: T = 2(p-1) max(alpha_intra + beta_intra n/p, alpha_inter + beta_inter n/p). With one node it is
    the single-level ring.

Hierarchical (the two-level all-reduce)
    1. reduce-scatter inside each node over g = gpus_per_node ranks: (g-1) alpha_intra + (g-1)/g n beta_intra;
    2. all-reduce of each rank's n/g shard across the N = nodes ranks holding the same shard, one per node:
       g such N-rank rings run at once and share the node's `nics_per_node` network links (each link at
       1/beta_inter), so each ring gets min(1, nics/g) of a link:
       2(N-1) alpha_inter + 2(N-1)/N (n/g) beta_inter x g / min(g, nics);
    3. all-gather inside each node: (g-1) alpha_intra + (g-1)/g n beta_intra.
    Per node the network carries 2(N-1)/N n instead of the flat ring's 2(p-1)/p n, in 2(N-1) latency steps
    instead of 2(p-1): hierarchy wins small messages (fewer network latency steps) and wins when the inter-node
    link is the slow one. Its three phases run one after the other while the flat ring pipelines all edges at
    once, so with links of similar speed the flat ring wins large messages (:func:`crossover_bytes`).

Both are 0 for p = 1. The levels' alpha and beta come from calibrating each level: within a node, and with
one rank per node across nodes (lab 7).
"""

from __future__ import annotations

import numpy as np

from dtlab.model.costmodel import check_nbytes, scalar_or_array

ALGORITHMS = ("flat", "hierarchical")


def _check_levels(nodes, gpus_per_node):
    for name, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return int(nodes), int(gpus_per_node)


def flat_ring_allreduce(
    alpha_intra, beta_intra, alpha_inter, beta_inter, nbytes, nodes: int, gpus_per_node: int, nics_per_node: int = 1
):
    """One ring over nodes x gpus_per_node ranks, each step as slow as its slowest edge (seconds). One ring
    crosses each node boundary once: it uses one network link whatever `nics_per_node` (accepted for a
    uniform signature)."""
    nodes, g = _check_levels(nodes, gpus_per_node)
    p = nodes * g
    n = check_nbytes(nbytes)
    if p == 1:
        return scalar_or_array(np.zeros_like(n))
    intra = alpha_intra + beta_intra * n / p if g > 1 else np.zeros_like(n)
    inter = alpha_inter + beta_inter * n / p if nodes > 1 else np.zeros_like(n)
    return scalar_or_array(2 * (p - 1) * np.maximum(intra, inter))


def hierarchical_allreduce(
    alpha_intra, beta_intra, alpha_inter, beta_inter, nbytes, nodes: int, gpus_per_node: int, nics_per_node: int = 1
):
    """Reduce-scatter in the node, all-reduce of the shard across nodes (g rings sharing `nics_per_node`
    links), all-gather in the node (seconds)."""
    nodes, g = _check_levels(nodes, gpus_per_node)
    _, nics = _check_levels(1, nics_per_node)
    n = check_nbytes(nbytes)
    intra = 2 * ((g - 1) * alpha_intra + (g - 1) / g * n * beta_intra)
    share = g / min(g, nics)  # each of the g concurrent rings gets min(1, nics/g) of a link
    inter = 2 * (nodes - 1) * alpha_inter + 2 * (nodes - 1) / nodes * (n / g) * beta_inter * share
    return scalar_or_array(intra + inter)


def two_level_time(
    algorithm: str,
    alpha_intra,
    beta_intra,
    alpha_inter,
    beta_inter,
    nbytes,
    nodes: int,
    gpus_per_node: int,
    nics_per_node: int = 1,
):
    """:func:`flat_ring_allreduce` or :func:`hierarchical_allreduce` by name ('flat' or 'hierarchical')."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    f = flat_ring_allreduce if algorithm == "flat" else hierarchical_allreduce
    return f(alpha_intra, beta_intra, alpha_inter, beta_inter, nbytes, nodes, gpus_per_node, nics_per_node)


def network_bytes_per_node(algorithm: str, nbytes, nodes: int, gpus_per_node: int):
    """Bytes one node sends into the network per all-reduce: the flat ring's one boundary edge carries
    2(p-1)/p n; the hierarchical form's g shard rings 2(N-1)/N n/g each, 2(N-1)/N n in all."""
    nodes, g = _check_levels(nodes, gpus_per_node)
    n = check_nbytes(nbytes)
    p = nodes * g
    if nodes == 1:
        return scalar_or_array(np.zeros_like(n))
    if algorithm == "flat":
        return scalar_or_array(2 * (p - 1) / p * n)
    if algorithm == "hierarchical":
        return scalar_or_array(2 * (nodes - 1) / nodes * n)
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def crossover_bytes(link, nodes: int, lo: float = 1.0, hi: float = 2.0**40):
    """The message size (bytes) where the faster of flat and hierarchical changes on `link` (a
    dtlab.model.link.TwoLevelLink: its two levels' alpha and beta, gpus_per_node and nics_per_node; its own
    algorithm is not used: both are compared) with `nodes` nodes, or None when one of them is at least as fast at
    every size in [lo, hi] (found on a log grid, then bisected)."""
    if not all(hasattr(link, k) for k in ("intra", "inter", "gpus_per_node", "nics_per_node")):
        raise ValueError(f"link must be a TwoLevelLink (dtlab.model.link), got {type(link).__name__}")
    gpus_per_node, nics_per_node = link.gpus_per_node, link.nics_per_node
    grid = np.logspace(np.log2(lo), np.log2(hi), 400, base=2.0)
    args = (link.intra.alpha, link.intra.beta, link.inter.alpha, link.inter.beta)

    def diff(n):
        return hierarchical_allreduce(*args, n, nodes, gpus_per_node, nics_per_node) - flat_ring_allreduce(
            *args, n, nodes, gpus_per_node
        )

    sign = np.sign(diff(grid))
    change = np.nonzero(sign[:-1] * sign[1:] < 0)[0]
    if len(change) == 0:
        return None
    a, b = grid[change[0]], grid[change[0] + 1]
    s_a = np.sign(diff(a))
    for _ in range(60):
        m = np.sqrt(a * b)
        a, b = (m, b) if np.sign(diff(m)) == s_a else (a, m)
    return float(np.sqrt(a * b))


def level_from_profile(profile, op: str = "all_reduce") -> tuple[float, float, str]:
    """(alpha s, beta s/B, how) of one level from its calibration profile: the profile's ring fit when both are
    usable (beta > 0; a negative alpha, which large sizes do not resolve, is clipped to 0), else an estimate
    from the largest measured size alone (alpha 0, beta from its median time through the ring's
    2(p-1)/p n bytes), labelled as such: a short, noisy sweep can fit beta <= 0."""
    fit = profile.fits.get(op)
    if fit is not None and np.isfinite(fit.beta) and fit.beta > 0 and np.isfinite(fit.alpha):
        how = "fitted" + (", negative alpha clipped to 0" if fit.alpha < 0 else "")
        return max(float(fit.alpha), 0.0), float(fit.beta), how
    s = profile.samples[profile.samples["op"] == op]
    if s.empty:
        raise ValueError(f"the profile has no {op} samples to take a level from")
    n = float(s["nbytes"].max())
    big = s[s["nbytes"] == n]
    p = int(big["nproc"].max())
    t = float(big["seconds"].median())
    return (
        0.0,
        t / (2 * (p - 1) / p * n),
        (f"estimated from the {n / 2**20:.3g} MiB median alone (the fit gave beta <= 0)"),
    )


def levels_from_profiles(intra, inter, op: str = "all_reduce") -> dict:
    """The two levels for :func:`two_level_time` and the two-level explorer, from a profile measured inside a
    node and one measured across nodes (one rank per node), with a `source` line saying how each was obtained."""
    a_i, b_i, how_i = level_from_profile(intra, op)
    a_e, b_e, how_e = level_from_profile(inter, op)
    return {
        "alpha_intra": a_i,
        "beta_intra": b_i,
        "alpha_inter": a_e,
        "beta_inter": b_e,
        "source": f"calibrated here: inside a node ({how_i}), between nodes ({how_e})",
    }
