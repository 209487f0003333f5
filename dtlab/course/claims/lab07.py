"""The claims lab 7 prints (dtlab.course.claims): between nodes is slower than inside a node, from the two
calibrations, and backward costs about twice forward, from the no-op-hook baseline steps of a run."""

from __future__ import annotations

from dtlab.course.claims import compare, spread
from dtlab.units import fmt_time


def levels_claim(intra, inter, link: str, min_bytes: int = 4 * 2**20):
    """'Between nodes is slower than inside a node' from the two calibrations, size by size, at the sizes
    (>= min_bytes) where the bandwidth term dominates."""
    a = inter.samples.groupby("nbytes")["seconds"].median()
    b = intra.samples.groupby("nbytes")["seconds"].median()
    common = [n for n in a.index if n in b.index]
    sizes = [n for n in common if n >= min_bytes] or common[-3:]
    shaped = "shaped" in link

    def why(outcome):
        if not shaped:
            return (
                "no shaped link here: both levels are loopback TCP on the same cores (the lab said so at the "
                "top), so the 'network' is as fast as a copy inside the machine."
            )
        odd = [n for n in sizes if a[n] <= b[n]]
        return (
            f"the link is {link}, but at {', '.join(f'{n:,} B' for n in odd) or 'some sizes'} the all-reduce "
            "inside a node measured as slow as between nodes: the two emulated nodes share this machine's "
            "cores, and a calibration call that waits for a core scatters (compare its neighbours in the "
            "table above)."
        )

    return compare(
        "lab07.levels",
        "the all-reduce between nodes is slower than inside a node",
        "all-reduce time",
        ("between nodes", [a[n] for n in sizes]),
        ("inside a node", [b[n] for n in sizes]),
        expected=None,
        model=f"the inter-node link ({link}) against copies inside one machine",
        test="above",
        why=why,
        per="size",
        how=f"sizes {sizes[0]:,} .. {sizes[-1]:,} B, paired by size",
    )


def backward_claim(run):
    """'Backward costs about twice forward' on the no-op baseline steps of a run (slowest rank per step)."""
    base = run.baseline_steps
    slow = base.loc[base.groupby("step")["t_step"].idxmax()]
    fwd, bwd = list(slow["t_fwd"]), list(slow["t_bwd"])

    def why(outcome):
        f, b = spread(fwd), spread(bwd)
        return (
            "the factor 2 counts arithmetic. Here forward also holds a collective: DDP broadcasts the model's "
            "buffers (DistilBERT's position_ids) from rank 0 at the start of every forward (broadcast_buffers, "
            "on by default), in the no-op-hook baseline too, so t_fwd includes waiting for the other node's rank. "
            f"And on shared cores the steps scatter: over {f.n} baseline steps forward took {fmt_time(f.lo)} .. "
            f"{fmt_time(f.hi)} and backward {fmt_time(b.lo)} .. {fmt_time(b.hi)}. The model below uses these "
            "medians as measured."
        )

    return compare(
        "lab07.backward",
        "backward costs about twice forward (it computes the gradients of both the weights and the activations)",
        "compute per step (no-op hook baseline)",
        ("backward", bwd),
        ("forward", fwd),
        expected=2.0,
        model="about 2x the forward pass's arithmetic (Kaplan et al. "
        "2020, 'Scaling Laws for Neural Language Models', section 2.1)",
        rel_tol=0.5,
        why=why,
        per="step",
        how="pairs of the same baseline step",
    )
