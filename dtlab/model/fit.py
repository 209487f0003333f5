"""Fit alpha (seconds) and beta (seconds per byte) to measured collectives.

The model is linear in the unknowns: t = alpha * A(p) + beta * B(p) * n,
with A and B from :func:`dtlab.model.costmodel.coefficients` for the chosen form.

Choices, and why:

* Fit to the per-(nbytes, nproc) **median** of the timed iterations. Timing
  samples have a heavy right tail (OS jitter, first-call effects); the
  median is robust to it and gives every size exactly one vote. The number
  of raw samples behind each point is kept.
* Weighted least squares with weights 1/t, i.e. minimise
  sum(((t_i - pred_i) / t_i)^2). Sizes span many orders of magnitude; plain
  least squares would let the largest messages decide everything and leave
  alpha (which only shows at small sizes) meaningless.
* Confidence intervals come from the WLS covariance with a t-distribution on
  (points - 2) degrees of freedom. They describe how well the medians fit
  the straight line, not the run-to-run noise of single iterations.
* Points with p = 1 are left out: the model predicts 0 there (no peer), but
  a real library still spends a few microseconds per call.
* A negative alpha or beta is physically meaningless but is kept as fitted
  and reported in ``warnings``; clipping would silently hide a bad size
  range or a model that does not fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import stats
from scipy.optimize import nnls

from dtlab.model import costmodel

REQUIRED_COLUMNS = ("op", "nbytes", "nproc", "seconds")
PROFILE_FILE = "profile.json"


@dataclass(kw_only=True)
class AlphaBetaFit:
    """Fitted alpha-beta model of one collective.

    alpha: seconds; beta: seconds per byte; *_ci: (low, high) confidence
    interval; min_bytes/max_bytes: smallest/largest message size (bytes)
    actually used; n_points: distinct (nbytes, nproc) points; n_samples: raw
    samples behind them; residuals: one dict per point with nbytes, nproc,
    measured, predicted (seconds), rel_error ((predicted - measured) /
    measured) and count; rel_rms: root-mean-square of rel_error.
    """

    op: str
    form: str
    alpha: float
    beta: float
    alpha_ci: tuple[float, float]
    beta_ci: tuple[float, float]
    min_bytes: int
    max_bytes: int
    n_points: int
    n_samples: int
    residuals: list[dict] = field(default_factory=list)
    rel_rms: float = float("nan")
    confidence: float = 0.95
    warnings: list[str] = field(default_factory=list)
    nprocs: list[int] = field(default_factory=list)
    """The process counts the fit saw (fits saved before this field existed load with [] = not recorded)."""

    def predict(self, nbytes, nproc):
        """Predicted seconds for message size nbytes (bytes) on nproc processes."""
        return costmodel.collective_time(self.op, self.form, self.alpha, self.beta, nbytes, nproc)

    def to_dict(self) -> dict:
        """JSON-safe dict (plain floats/ints/lists)."""
        d = dataclasses.asdict(self)
        d["alpha_ci"] = [float(x) for x in self.alpha_ci]
        d["beta_ci"] = [float(x) for x in self.beta_ci]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AlphaBetaFit:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["alpha_ci"] = tuple(d["alpha_ci"])
        d["beta_ci"] = tuple(d["beta_ci"])
        return cls(**d)


def check_samples(samples) -> None:
    if not isinstance(samples, pd.DataFrame):
        raise ValueError(f"samples must be a pandas DataFrame, got {type(samples).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in samples.columns]
    if missing:
        raise ValueError(f"samples is missing columns {missing}; required: {list(REQUIRED_COLUMNS)}")


def fit_alpha_beta(
    samples: pd.DataFrame,
    op: str,
    form: str = "ring",
    min_bytes=None,
    max_bytes=None,
    confidence: float = 0.95,
    nonneg: bool = False,
) -> AlphaBetaFit:
    """Fit alpha (seconds) and beta (seconds/byte) for `op` by weighted least squares.

    samples: one row per timed iteration with columns op, nbytes (bytes),
    nproc, seconds; other columns are ignored. Only rows of `op` with
    min_bytes <= nbytes <= max_bytes (inclusive; None = unbounded) and
    nproc > 1 are used. See the module docstring for the method.

    nonneg=True constrains alpha and beta to >= 0 (non-negative least squares on the same weighted system)
    when the free fit would make one negative: a latency-bound range, where time barely grows with size,
    then gets beta = 0 and a warning that says so. Intervals stay those of the free fit.
    """
    check_samples(samples)
    costmodel.coefficients(op, form, 2)  # validates op and form with clear messages
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be strictly between 0 and 1, got {confidence!r}")
    pts = _median_points(samples, op, min_bytes, max_bytes)

    n = pts["nbytes"].to_numpy(dtype=float)
    p = pts["nproc"].to_numpy(dtype=float)
    t = pts["median"].to_numpy(dtype=float)
    a, b = costmodel.coefficients(op, form, p)
    X = np.column_stack([a, b * n])
    coef, Xs, scale, constrained = _solve(X, t, op, nonneg)
    alpha, beta = float(coef[0]), float(coef[1])

    pred = X @ coef
    rel = (pred - t) / t
    q, se = _interval_terms(Xs, scale, rel, confidence)
    residuals = [
        {
            "nbytes": int(n_i),
            "nproc": int(p_i),
            "measured": float(t_i),
            "predicted": float(pr),
            "rel_error": float(r),
            "count": int(c),
        }
        for n_i, p_i, t_i, pr, r, c in zip(n, p, t, pred, rel, pts["count"])
    ]
    return AlphaBetaFit(
        op=op,
        form=form,
        alpha=alpha,
        beta=beta,
        alpha_ci=(float(alpha - q * se[0]), float(alpha + q * se[0])),
        beta_ci=(float(beta - q * se[1]), float(beta + q * se[1])),
        min_bytes=int(n.min()),
        max_bytes=int(n.max()),
        n_points=len(t),
        n_samples=int(pts["count"].sum()),
        residuals=residuals,
        rel_rms=float(np.sqrt(np.mean(rel**2))),
        confidence=float(confidence),
        warnings=_fit_warnings(alpha, beta, constrained, n),
        nprocs=sorted({int(x) for x in p}),
    )


def _median_points(samples: pd.DataFrame, op: str, min_bytes=None, max_bytes=None) -> pd.DataFrame:
    """The points a fit uses: per (nbytes, nproc) with nproc > 1 and nbytes in [min_bytes, max_bytes], the
    median seconds and the count of samples behind it (columns nbytes, nproc, median, count). At least 3."""
    rows = samples[samples["op"] == op]
    if min_bytes is not None:
        rows = rows[rows["nbytes"] >= min_bytes]
    if max_bytes is not None:
        rows = rows[rows["nbytes"] <= max_bytes]
    rows = rows[rows["nproc"] > 1]
    secs = rows["seconds"].to_numpy(dtype=float)
    if np.any(~np.isfinite(secs)) or np.any(secs <= 0):
        raise ValueError(f"samples['seconds'] for op {op!r} must be finite and > 0")

    pts = rows.groupby(["nbytes", "nproc"], sort=True)["seconds"].agg(["median", "count"]).reset_index()
    if len(pts) < 3:
        raise ValueError(
            f"need at least 3 distinct (nbytes, nproc) points with nproc > 1 for op {op!r} "
            f"within min_bytes={min_bytes!r}, max_bytes={max_bytes!r}; found {len(pts)}"
        )
    return pts


def _solve(X, t, op: str, nonneg: bool):
    """Relative-error least squares for t = X @ (alpha, beta): (coef, the scaled weighted design matrix, its
    column scales, whether the non-negative solve replaced the free one)."""
    # dividing each row by t_i turns absolute errors into relative ones
    Xw = X / t[:, None]
    # alpha and beta columns differ by ~1e9 in scale; normalising them keeps
    # the solve and the covariance inverse well conditioned
    scale = np.linalg.norm(Xw, axis=0)
    scale[scale == 0] = 1.0
    Xs = Xw / scale
    cs, _, rank, _ = np.linalg.lstsq(Xs, np.ones_like(t), rcond=None)
    if rank < 2:
        raise ValueError(
            f"the points for op {op!r} cannot separate alpha from beta (design matrix rank {rank}); "
            "widen min_bytes/max_bytes or measure more message sizes"
        )
    coef = cs / scale
    constrained = nonneg and bool(np.any(coef < 0))
    if constrained:
        cs, _ = nnls(Xs, np.ones_like(t))
        coef = cs / scale
    return coef, Xs, scale, constrained


def _interval_terms(Xs, scale, rel, confidence: float):
    """(t quantile, standard errors of alpha and beta) from the WLS covariance on len(rel) - 2 degrees of
    freedom."""
    dof = len(rel) - 2
    sigma2 = float(np.sum(rel**2)) / dof
    cov = sigma2 * np.linalg.inv(Xs.T @ Xs) / np.outer(scale, scale)
    se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    q = float(stats.t.ppf(0.5 + confidence / 2, dof))
    return q, se


def _fit_warnings(alpha: float, beta: float, constrained: bool, n) -> list[str]:
    warnings = []
    if constrained:
        which = "beta" if beta == 0 else "alpha" if alpha == 0 else "alpha, beta"
        warnings.append(
            f"{which} held at 0 by the non-negative fit: in {int(n.min()):,}..{int(n.max()):,} B the "
            "time barely changes with size (latency-bound), so bandwidth is not visible here"
            if beta == 0
            else f"{which} held at 0 by the non-negative fit"
        )
    if alpha < 0:
        warnings.append(
            f"fitted alpha is negative ({alpha:.3g} s): the size range may not "
            "constrain latency; try including smaller messages"
        )
    if beta < 0:
        warnings.append(
            f"fitted beta is negative ({beta:.3g} s/B): the size range may not "
            "constrain bandwidth; try including larger messages"
        )
    return warnings


def fit_piecewise(
    samples: pd.DataFrame,
    op: str,
    form: str = "ring",
    max_segments: int = 3,
    min_points: int = 4,
    min_bytes=None,
    max_bytes=None,
    confidence: float = 0.95,
) -> list[AlphaBetaFit]:
    """Alpha-beta fits per size regime: real collectives switch algorithm or protocol with message size
    (gloo between 256 KiB and 1 MiB on this project's CI machine; NCCL between LL, LL128 and Simple, ring and
    tree, as its tuning model in src/graph/tuning.cc says), so one straight line cannot fit them all.

    Of every split of the sorted sizes into 1..max_segments contiguous regimes of at least `min_points` sizes,
    the one with the lowest BIC on the relative residuals, N ln(SSR/N) + (3k - 1) ln N for k regimes, is kept:
    each regime's alpha and beta and each breakpoint between regimes count as parameters, so a regime is added
    only when it explains the data better than the three it costs (mean squared residuals below 0.1 %, the
    digits nccl-tests prints, are no evidence of another regime). The search is
    exact and cheap: the best split into k regimes is found by dynamic programming over the residual sum of
    every contiguous run of sizes (N^2 small fits, not one fit per combination), so max_segments may be 5 or
    6 for a 30-size nccl-tests sweep. Regimes are fitted with alpha, beta >= 0 (see fit_alpha_beta's nonneg),
    a single full-range regime too: these are what predictions use, and noise in a few points must not invent
    negative latency or a time that falls with size (the unconstrained full-range fit stays in
    `Profile.fits`, with a warning when it is unphysical). Returns the fits, ascending; each records the sizes
    (min_bytes, max_bytes) and process counts (nprocs) it saw."""
    check_samples(samples)
    costmodel.coefficients(op, form, 2)
    if isinstance(max_segments, bool) or not isinstance(max_segments, int) or max_segments < 1:
        raise ValueError(f"max_segments must be an integer >= 1, got {max_segments!r}")
    if isinstance(min_points, bool) or not isinstance(min_points, int) or min_points < 3:
        raise ValueError(
            f"min_points must be an integer >= 3 (two parameters and one degree of freedom), got {min_points!r}"
        )
    sub = samples[samples["op"] == op]
    sizes = np.sort(sub["nbytes"].unique())
    if min_bytes is not None:
        sizes = sizes[sizes >= min_bytes]
    if max_bytes is not None:
        sizes = sizes[sizes <= max_bytes]
    edges = _best_edges(sub, op, form, sizes, max_segments, min_points)
    if edges is None:
        raise ValueError(f"op {op!r}: need at least {min_points} sizes in range to fit (min_bytes/max_bytes)")
    return [
        fit_alpha_beta(sub, op, form, sizes[a], sizes[b - 1], confidence, nonneg=True) for a, b in zip(edges, edges[1:])
    ]


def _best_edges(sub: pd.DataFrame, op: str, form: str, sizes, max_segments: int, min_points: int):
    """The split [0, e1, ..., N] of the sorted `sizes` with the lowest BIC (fit_piecewise), or None."""
    n_total = len(sizes)
    if n_total < min_points:
        return None
    rows = sub[(sub["nbytes"] >= sizes[0]) & (sub["nbytes"] <= sizes[-1]) & (sub["nproc"] > 1)]
    pts = rows.groupby(["nbytes", "nproc"], sort=True)["seconds"].median().reset_index()
    n_all, p_all, t_all = (pts[c].to_numpy(dtype=float) for c in ("nbytes", "nproc", "seconds"))
    if np.any(~np.isfinite(t_all)) or np.any(t_all <= 0):
        raise ValueError(f"samples['seconds'] for op {op!r} must be finite and > 0")
    which = np.searchsorted(sizes, n_all)  # the index of each point's size
    cost = np.full((n_total + 1, n_total + 1), np.inf)
    for i in range(n_total):
        for j in range(i + min_points, n_total + 1):
            cost[i, j] = _segment_ssr(n_all, p_all, t_all, (which >= i) & (which < j), op, form)
    # best[k][j]: the least SSR of sizes[:j] in k regimes; back[k][j]: where its last regime starts
    best = np.full((max_segments + 1, n_total + 1), np.inf)
    back = np.zeros((max_segments + 1, n_total + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, max_segments + 1):
        for j in range(k * min_points, n_total + 1):
            totals = best[k - 1, :j] + cost[:j, j]
            i = int(np.argmin(totals))
            best[k, j], back[k, j] = totals[i], i
    chosen, chosen_bic = None, np.inf
    for k in range(1, max_segments + 1):
        if not np.isfinite(best[k, n_total]):
            continue
        # residuals below 0.1 % (the digits nccl-tests prints) are no evidence of another regime
        bic = n_total * np.log(max(best[k, n_total] / n_total, 1e-6)) + (3 * k - 1) * np.log(n_total)
        if bic < chosen_bic:
            chosen, chosen_bic = k, bic
    if chosen is None:
        return None
    edges, j = [n_total], n_total
    for k in range(chosen, 0, -1):
        j = back[k, j]
        edges.append(j)
    return edges[::-1]


def _segment_ssr(n, p, t, mask, op: str, form: str) -> float:
    """The sum of squared relative residuals of the non-negative fit of the points in `mask` (inf when they
    cannot be fitted: fewer than 3, or alpha and beta not separable)."""
    if mask.sum() < 3:
        return np.inf
    a, b = costmodel.coefficients(op, form, p[mask])
    X = np.column_stack([a, b * n[mask]])
    try:
        coef, *_ = _solve(X, t[mask], op, nonneg=True)
    except ValueError:
        return np.inf
    return float(np.sum(((X @ coef - t[mask]) / t[mask]) ** 2))
