"""A calibrated machine profile: raw samples, alpha-beta fits per op (full range and per size regime), caveats,
and where it came from. Saved as PROFILE/profile.json; `load_profile(PROFILE)` reads it back."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dtlab.model.fit import PROFILE_FILE, REQUIRED_COLUMNS, AlphaBetaFit, check_samples, fit_alpha_beta, fit_piecewise
from dtlab.units import fmt_gbps, fmt_us


class OutsideFitWarning(UserWarning):
    """A prediction at a message size, process count or node count that the fit never saw."""


@dataclass(kw_only=True)
class Profile:
    """A calibrated machine profile: raw samples, per-op fits and caveats.

    meta: free-form JSON-safe dict (host, backend, devices, versions, nproc,
    notes, ...); samples: DataFrame with at least op, nbytes, nproc,
    seconds; fits: op -> AlphaBetaFit (each fit records its own form);
    caveats: human-readable honesty notes (e.g. "gloo on CPU: ...").
    """

    meta: dict = field(default_factory=dict)
    samples: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(REQUIRED_COLUMNS)))
    fits: dict[str, AlphaBetaFit] = field(default_factory=dict)
    caveats: list[str] = field(default_factory=list)
    segments: dict[str, list[AlphaBetaFit]] = field(default_factory=dict)
    """op -> alpha-beta fits per size regime (protocol switches), ascending; see fit_piecewise."""
    loaded_fits: dict[str, AlphaBetaFit] = field(default_factory=dict)
    """op -> the fit of samples timed under load ('backward': beside a replayed backward pass, `meta['load']`)."""
    loaded_segments: dict[str, list[AlphaBetaFit]] = field(default_factory=dict)
    """op -> the loaded fits per size regime."""

    def has_load(self, op: str) -> bool:
        """True when `op` was also timed under load, so `predict(..., load='backward')` prices it."""
        return op in self.loaded_fits

    def fit_range(self, op: str) -> dict:
        """What the fit of `op` saw: min_bytes and max_bytes (bytes), nprocs (the process counts; [] for a fit
        saved before they were recorded) and nodes (meta['nnodes'], 1 when not recorded)."""
        if op not in self.fits:
            raise ValueError(f"op {op!r} has no fit in this profile; fitted ops: {sorted(self.fits)}")
        f = self.fits[op]
        return {
            "min_bytes": f.min_bytes,
            "max_bytes": f.max_bytes,
            "nprocs": list(f.nprocs),
            "nodes": int(self.meta.get("nnodes") or 1),
        }

    def outside(self, op: str, nbytes, nproc, nodes=None):
        """Why a prediction of `op` at nbytes (bytes; scalar or array) on nproc processes (and `nodes` nodes, when
        given) leaves what the fit saw: one string per size, '' where it stays inside. A size outside
        [min_bytes, max_bytes], a process count the fit never timed, or another node count is extrapolation:
        NCCL changes protocol and algorithm with size, and busbw changes with p and across nodes."""
        r = self.fit_range(op)
        n = np.atleast_1d(np.asarray(nbytes, dtype=float))
        common = []
        if r["nprocs"] and int(nproc) not in r["nprocs"]:
            common.append(f"{int(nproc)} processes (fitted at {', '.join(map(str, r['nprocs']))})")
        if nodes is not None and int(nodes) != r["nodes"]:
            common.append(f"{int(nodes)} node(s) (fitted on {r['nodes']})")
        out = []
        for x in n:
            why = list(common)
            if x < r["min_bytes"] or x > r["max_bytes"]:
                why.append(f"{int(x):,} B (fitted {r['min_bytes']:,}..{r['max_bytes']:,} B)")
            out.append("; ".join(why))
        return np.asarray(out, dtype=object)

    def predict(
        self, op: str, nbytes, nproc, piecewise: bool = True, load: str = "idle", warn: bool = False, nodes=None
    ):
        """Predicted seconds of `op` for nbytes (bytes) on nproc processes; `load` 'backward' prices it with the
        fit of the samples timed beside a replayed backward pass (ValueError when the profile has none).

        With piecewise=True (default) and regimes fitted, each size is priced by the regime it falls in
        (boundaries at the geometric midpoint between neighbouring regimes; regimes are fitted with alpha,
        beta >= 0, so predictions never fall with size); otherwise the unconstrained full-range fit is used.
        warn=True issues an OutsideFitWarning naming every size, process count or node count (`nodes`) outside
        what the fit saw (`outside` says the same per size, without warning)."""
        if warn and op in self.fits:
            why = sorted({w for w in self.outside(op, nbytes, nproc, nodes) if w})
            if why:
                warnings.warn(
                    f"{op} predicted outside what its fit saw (extrapolated, not measured): {' | '.join(why)}",
                    OutsideFitWarning,
                    stacklevel=2,
                )
        if load not in ("idle", "backward"):
            raise ValueError(f"load must be 'idle' or 'backward', got {load!r}")
        fits, segments = (self.fits, self.segments) if load == "idle" else (self.loaded_fits, self.loaded_segments)
        if op not in fits:
            what = "fit" if load == "idle" else "loaded fit (calibrate with load='backward')"
            raise ValueError(f"op {op!r} has no {what} in this profile; fitted ops: {sorted(fits)}")
        segs = segments.get(op) or []
        if not piecewise or not segs:
            return fits[op].predict(nbytes, nproc)
        if len(segs) == 1:
            return segs[0].predict(nbytes, nproc)
        n = np.asarray(nbytes, dtype=float)
        bounds = [np.sqrt(a.max_bytes * b.min_bytes) for a, b in zip(segs, segs[1:])]
        idx = np.searchsorted(bounds, n, side="right")
        out = np.choose(idx, [np.asarray(sg.predict(n, nproc), dtype=float) * np.ones_like(n) for sg in segs])
        return float(out) if np.ndim(out) == 0 else out

    def fit_all(
        self, form: str = "ring", min_bytes=None, max_bytes=None, confidence: float = 0.95, max_segments: int = 3
    ) -> Profile:
        """(Re)fit every op present in samples; returns self. max_segments: the most size regimes
        (fit_piecewise) per op.

        An op that cannot be fitted (e.g. too few sizes) is skipped and a
        caveat says why, so one thin op does not lose the whole profile.
        """
        check_samples(self.samples)
        self.fits, self.segments, self.loaded_fits, self.loaded_segments = {}, {}, {}, {}
        load = self.samples["load"].fillna("idle") if "load" in self.samples.columns else None
        for how, fits, segments in (
            ("idle", self.fits, self.segments),
            ("backward", self.loaded_fits, self.loaded_segments),
        ):
            if load is None:  # samples from before loads were recorded: all of them idle
                s = self.samples if how == "idle" else self.samples.iloc[:0]
            else:
                s = self.samples[load == how]
            if s.empty:
                continue
            for op in sorted(s["op"].unique()):
                try:
                    fits[op] = fit_alpha_beta(s, op, form, min_bytes, max_bytes, confidence)
                    segments[op] = fit_piecewise(
                        s,
                        op,
                        form,
                        max_segments=max_segments,
                        min_bytes=min_bytes,
                        max_bytes=max_bytes,
                        confidence=confidence,
                    )
                except ValueError as err:
                    note = f"{op}{'' if how == 'idle' else ' (loaded)'} not fitted: {err}"
                    if note not in self.caveats:
                        self.caveats.append(note)
        return self

    @classmethod
    def from_samples(
        cls,
        samples: pd.DataFrame,
        meta: dict | None = None,
        form: str = "ring",
        min_bytes=None,
        max_bytes=None,
        confidence: float = 0.95,
        caveats: list[str] | None = None,
        max_segments: int = 3,
    ) -> Profile:
        """Build a Profile from raw samples and fit every op present (at most max_segments size regimes each)."""
        prof = cls(meta=dict(meta or {}), samples=samples.reset_index(drop=True), caveats=list(caveats or []))
        return prof.fit_all(form, min_bytes, max_bytes, confidence, max_segments)

    def save(self, path) -> str:
        """Write ``profile.json`` into directory `path` (created if needed); return its path."""
        os.makedirs(path, exist_ok=True)
        doc = {
            "format": "dtlab-profile",
            "version": 1,
            "meta": self.meta,
            "fits": {op: f.to_dict() for op, f in self.fits.items()},
            "caveats": list(self.caveats),
            "segments": {op: [f.to_dict() for f in segs] for op, segs in self.segments.items()},
            "loaded_fits": {op: f.to_dict() for op, f in self.loaded_fits.items()},
            "loaded_segments": {op: [f.to_dict() for f in segs] for op, segs in self.loaded_segments.items()},
            # to_json handles numpy scalars and NaN (-> null) for us
            "samples": json.loads(self.samples.to_json(orient="records")),
        }
        out = os.path.join(path, PROFILE_FILE)
        with open(out, "w", encoding="utf-8") as fh:
            # default=str so an odd meta value (a Path, a version object) never blocks saving
            json.dump(doc, fh, indent=1, default=str)
        return out


def profile_table(profile) -> str:
    """The fitted alpha (microseconds) and beta (as GB/s) per op with 95% intervals, and the caveats."""
    m = profile.meta
    nodes = m.get("nnodes", 1)
    where = (
        f"{nodes} nodes x {m.get('ranks_per_node')} | hosts {', '.join(m.get('hosts', [])) or '?'}"
        if nodes > 1
        else f"host {m.get('host')}"
    )
    versions = m.get("versions", {})
    # a calibration records torch's version; nccl-tests output its own and NCCL's, when it printed them
    vtext = (
        f"torch {versions.get('torch')}"
        if "torch" in versions or "source" not in m
        else ", ".join(f"{k} {v}" for k, v in versions.items() if k != "nccl_headers") or "versions not printed"
    )
    name = m.get("calibration", {}).get("out", "") or m.get("source", {}).get("file", "")
    lines = [f"profile {name}: {m.get('backend')} | {m.get('world_size')} ranks | {where} | {vtext}"]
    for op, f in sorted(profile.fits.items()):
        lo, hi = f.alpha_ci
        blo, bhi = f.beta_ci
        bw = lambda b: fmt_gbps(1 / b) if b > 0 else "inf"  # noqa: E731
        lines.append(
            f"  {op:<15} {f.form:<8} alpha {fmt_us(f.alpha):>10} [{fmt_us(lo)}, {fmt_us(hi)}]   "
            f"1/beta {bw(f.beta)} [{bw(bhi)}, {bw(blo)}]   rel. RMS error {f.rel_rms:.1%}   "
            f"sizes {f.min_bytes:,}..{f.max_bytes:,} B"
        )
    for c in profile.caveats:
        lines.append(f"  note: {c}")
    return "\n".join(lines)
