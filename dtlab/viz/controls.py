"""What the explorers' controls can change, and what the compression control means, without widgets.

- :func:`bucket_slider_range`: the bucket sizes over which the bucket count changes for a model's gradients.
  Below the range every tensor already has a bucket of its own; above it everything is one bucket. A slider
  wider than that moves without changing anything (the tiny model is one bucket from 4 MiB up); a model
  whose count never changes gets no bucket slider at all.
- :func:`all_reduce_fits`: the alpha and beta a profile offers the explorer, per form, with a sentence each.
- :func:`compression_setting`: the compression ratio r and encode cost the model uses for the value the r
  slider shows, and a sentence saying where each comes from. The encode cost was measured with one hook at
  one r: at r = 1 nothing is compressed and nothing is encoded; at another r < 1 the measured cost is reused
  and labelled as the estimate it is.

Pure: numpy and :mod:`dtlab.model.buckets`; no ipywidgets, no plotly.
"""

from __future__ import annotations

import numpy as np

from dtlab.model.buckets import bucket_layout
from dtlab.units import MIB, fmt_bytes
from dtlab.viz.loggrid import on_log_grid

#: the r slider's step in exponent units (base 10), shared with the explorer's LOG_SLIDERS
R_STEP = 0.02
#: the all-reduce forms as the label writes them
FORMULAS = {"ring": "2(p−1)α + 2(p−1)/p·nβ", "textbook": "α(p−1) + nβ/p"}


def bucket_count(sizes, bucket_mb: float) -> int:
    """Buckets DDP makes of gradients `sizes` (bytes, ready order) with a cap of `bucket_mb` MiB."""
    return len(bucket_layout(sizes, bucket_mb * MIB, bucket_mb * MIB))


def bucket_slider_range(sizes, lo_exp: float = -7.0, hi_exp: float = 10.0, step: float = 0.05, base: float = 2.0):
    """(lo, hi) exponents (MiB = base ** exponent, on the slider's step grid from `lo_exp`) between which the
    bucket count of `sizes` changes: `hi` is the smallest cap that gives one bucket, `lo` the largest cap that
    still gives as many buckets as the smallest cap of the range. None when the count is the same over the
    whole of [lo_exp, hi_exp] (a control that could change nothing)."""
    sizes = [int(s) for s in sizes]
    if not sizes or sum(sizes) <= 0:
        raise ValueError("sizes must list gradient sizes in bytes with a positive total")
    grid = lo_exp + step * np.arange(int(round((hi_exp - lo_exp) / step)) + 1)
    counts = [bucket_count(sizes, float(base**e)) for e in grid]
    if counts[0] == counts[-1]:
        return None
    one = next(i for i, c in enumerate(counts) if c == counts[-1])
    first = max(i for i in range(one + 1) if counts[i] == counts[0])
    return float(grid[first]), float(grid[one])


def clip_to_range(value: float, rng, base: float = 2.0) -> float:
    """`value` (MiB) moved into the range's [base ** lo, base ** hi] (unchanged without a range)."""
    if rng is None:
        return float(value)
    return float(min(max(value, base ** rng[0]), base ** rng[1]))


def compression_setting(comp: dict, r_shown: float) -> tuple[float, float, str]:
    """(r, encode_s_per_byte, sentence) for the value the r slider shows. comp: the measured compression
    (ratio, encode_s_per_byte, source), or the default r = 1."""
    r0, enc0 = float(comp["ratio"]), float(comp.get("encode_s_per_byte", 0.0))
    src = comp["source"]
    if on_log_grid(r_shown, r0, 10, R_STEP):
        r = r0
        if r0 >= 1:
            return r, 0.0, f"r = 1: no compression ({src})"
        return r, enc0, f"r = {r:.3g} and encode {enc0 * 1e9:.3g} ns/B added to backward ({src})"
    r = float(r_shown)
    if r >= 1 or on_log_grid(r, 1.0, 10, R_STEP):
        return (
            1.0,
            0.0,
            (f"r = 1: no compression and no encode cost (moved by you; the measured hook had r = {r0:.3g})"),
        )
    if enc0 > 0:
        return (
            r,
            enc0,
            (
                f"r = {r:.3g}: moved by you; encode {enc0 * 1e9:.3g} ns/B as measured for the hook at "
                f"r = {r0:.3g}, assumed the same at r = {r:.3g} (an estimate)"
            ),
        )
    return r, 0.0, f"r = {r:.3g}: moved by you; no encode cost (none was measured: an estimate)"


def all_reduce_fits(profile) -> dict:
    """form -> (alpha s, beta s/B, how) for all_reduce: the profile's own fit, plus a fit of the other form
    from the profile's samples when they allow one; `how` says which, for the label. Fits with alpha or
    beta <= 0 are left out (a log slider cannot show them, and they are not physical)."""
    from dtlab.model.fit import fit_alpha_beta  # scipy import deferred: explorer() without a profile does not need it

    fits = {}
    own = profile.fits.get("all_reduce")
    if own is not None:
        fits[own.form] = own
    for form in ("ring", "textbook"):
        if form not in fits and own is not None and len(profile.samples):
            try:
                fits[form] = fit_alpha_beta(
                    profile.samples,
                    "all_reduce",
                    form,
                    min_bytes=own.min_bytes,
                    max_bytes=own.max_bytes,
                    confidence=own.confidence,
                )
            except ValueError:
                pass
    out = {}
    for f, x in fits.items():
        if not (x.alpha > 0 and x.beta > 0):
            continue
        what = (
            f"fitted from the profile: all_reduce, {f} form {FORMULAS.get(f, '')}, "
            f"{fmt_bytes(x.min_bytes)} to {fmt_bytes(x.max_bytes)}"
        )
        if f != own.form:
            what += f" (refitted from the profile's samples; the profile's own fit is {own.form})"
        out[f] = (x.alpha, x.beta, what)
    return out
