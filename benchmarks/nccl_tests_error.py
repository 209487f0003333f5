"""The alpha-beta model against real clusters' nccl-tests output: fit on part of each shipped output, predict the
rest, and report the error (docs/benchmarks.md, "The model against real clusters").

- held-out sizes: on every shipped output, hold out every other size of 1 MiB and more and predict them from
  the rest of the output (every size below 1 MiB and the other half above), and from the other half alone; the
  single alpha-beta line (what dtlab fitted before regimes were chosen from the data) beside the piecewise fit
  (dtlab.model.fit.fit_piecewise, up to 5 regimes by BIC, at least 4 sizes each);
- other GPU counts: the same box at 2 and 4 GPUs (fit at one, predict the other, both ways);
- other node counts: one node to two (fit 1 x 8, predict 2 x 8) and the reverse, 2 x 1 to 2 x 4 on one network,
  and one InfiniBand cluster at 2, 4 and 8 nodes of 8 H100 (16, 32 and 64 GPUs), fitted at one count and
  predicting the others; another cluster of the same kind at the same count.

Every cross prediction is made two ways: the ring form fitted at one count and carried to the other (alpha and
beta from p to p'), and nccl-tests' own premise that bus bandwidth does not depend on the rank count (each size's
measured time scaled by the ratio of the ops' bus factors, doc/PERFORMANCE.md of nccl-tests; only sizes both
outputs posted). Their errors are split into sizes of 1 to 32 MiB (latency and protocol choices dominate) and of
256 MiB and more (bandwidth dominates), which tells which part of the curve moved.

Error = (predicted - measured) / measured time of a size (the median of out-of-place and in-place). No timing of
this machine is involved: every figure comes from the posted tables and the fits, so it is the same on every run.

    python benchmarks/nccl_tests_error.py [--json out.json] [--markdown]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pandas as pd

from dtlab.model.profile import Profile
from dtlab.results.nccl_profile import MAX_SEGMENTS, public_nccl_tests
from dtlab.results.nccl_tests import BUS_FACTOR

MIB = 2**20
#: the two size bands a cross prediction's error is split into (bytes, inclusive)
SMALL, LARGE = (MIB, 32 * MIB), (256 * MIB, float("inf"))
#: (fit on, predict, what changes): the pairs the shipped outputs allow
CROSS = [
    ("rtx4090-pcie-1x2", "rtx4090-pcie-1x4", "GPU count 2 -> 4, one PCIe box"),
    ("rtx4090-pcie-1x4", "rtx4090-pcie-1x2", "GPU count 4 -> 2, one PCIe box"),
    ("aws-p5-1x8-h100-nvswitch", "aws-p5-2x8-h100-efa", "1 node -> 2 nodes (p5, EFA)"),
    ("aws-p5-2x8-h100-efa", "aws-p5-1x8-h100-nvswitch", "2 nodes -> 1 node (p5)"),
    ("cscs-alps-gh200-2x1-slingshot", "cscs-alps-gh200-2x4-slingshot", "2 x 1 -> 2 x 4 GPUs (Alps, Slingshot)"),
    ("cscs-alps-gh200-2x4-slingshot", "cscs-alps-gh200-2x1-slingshot", "2 x 4 -> 2 x 1 GPUs (Alps, Slingshot)"),
    ("h100-ib-ndr-2x8", "h100-ib-ndr-4x8", "2 -> 4 nodes, 16 -> 32 GPUs (H100, InfiniBand)"),
    ("h100-ib-ndr-2x8", "h100-ib-ndr-8x8", "2 -> 8 nodes, 16 -> 64 GPUs (H100, InfiniBand)"),
    ("h100-ib-ndr-4x8", "h100-ib-ndr-8x8", "4 -> 8 nodes, 32 -> 64 GPUs (H100, InfiniBand)"),
    ("h100-ib-ndr-8x8", "h100-ib-ndr-4x8", "8 -> 4 nodes, 64 -> 32 GPUs (H100, InfiniBand)"),
    ("h100-ib-ndr-4x8", "h100-ib-ndr-2x8", "4 -> 2 nodes, 32 -> 16 GPUs (H100, InfiniBand)"),
    ("h100-ib-ndr-2x8-ring-tuned", "h100-ib-ndr-8x8-tuned", "2 -> 8 nodes, ring forced at 2, both tuned"),
    ("dell-xe9680-2x8-h100-ib", "dell-xe9680-4x8-h100-ib", "2 -> 4 nodes, 16 -> 32 GPUs (XE9680, InfiniBand)"),
    ("dell-xe9680-4x8-h100-ib", "dell-xe9680-2x8-h100-ib", "4 -> 2 nodes, 32 -> 16 GPUs (XE9680, InfiniBand)"),
    ("h100-ib-ndr-4x8", "dell-xe9680-4x8-h100-ib", "another cluster of the same kind, 32 GPUs on 4 nodes"),
]


def op_of(profile: Profile) -> str:
    """The collective a profile read from nccl-tests timed."""
    return profile.meta["source"]["op"]


def points(profile: Profile) -> pd.DataFrame:
    """One row per size: nbytes, nproc, measured seconds (median of the two columns)."""
    s = profile.samples
    return s.groupby(["nbytes", "nproc"])["seconds"].median().reset_index()


def fitted(profile: Profile, keep) -> Profile:
    """A Profile fitted on the samples whose nbytes are in `keep`."""
    s = profile.samples[profile.samples["nbytes"].isin(keep)]
    return Profile.from_samples(s, meta=profile.meta, max_segments=MAX_SEGMENTS)


def errors(fit: Profile, pts: pd.DataFrame, op: str) -> pd.DataFrame:
    """Relative time errors of the piecewise fit and the single line at `pts`, and the regime each falls in."""
    n, p = pts["nbytes"].to_numpy(dtype=float), int(pts["nproc"].iloc[0])
    piece = np.asarray(fit.predict(op, n, p), dtype=float)
    line = np.asarray(fit.predict(op, n, p, piecewise=False), dtype=float)
    segs = fit.segments[op]
    bounds = [np.sqrt(a.max_bytes * b.min_bytes) for a, b in zip(segs, segs[1:])]
    return pd.DataFrame(
        {
            "nbytes": pts["nbytes"].to_numpy(),
            "piecewise": piece / pts["seconds"].to_numpy() - 1,
            "line": line / pts["seconds"].to_numpy() - 1,
            "regime": np.searchsorted(bounds, n, side="right") + 1,
            "regimes": len(segs),
        }
    )


def held_out(name: str) -> tuple[dict, pd.DataFrame]:
    """Hold out every other size >= 1 MiB (the 2nd, 4th, ...) and predict them from fits of the rest: the output
    without them (every size below 1 MiB and the other half above), and, narrower, the other half alone."""
    prof = public_nccl_tests(name)
    op = op_of(prof)
    pts = points(prof)
    big = pts[pts["nbytes"] >= MIB].reset_index(drop=True)
    train, test = big.iloc[::2], big.iloc[1::2]
    fit = fitted(prof, set(pts["nbytes"]) - set(test["nbytes"]))
    narrow = fitted(prof, set(train["nbytes"]))
    e, en = errors(fit, test, op), errors(narrow, test, op)
    system = prof.meta["source"]["system"]
    row = {
        "name": name,
        "op": op,
        "gpus": prof.meta["world_size"],
        "nodes": prof.meta["nnodes"],
        "fabric": system["interconnect"],
        "fit_sizes": len(pts) - len(test),
        "held_out": len(test),
        "regimes": int(e["regimes"].iloc[0]),
        "line_median": float(e["line"].abs().median()),
        "line_worst": float(e["line"].abs().max()),
        "piecewise_median": float(e["piecewise"].abs().median()),
        "piecewise_worst": float(e["piecewise"].abs().max()),
        "narrow_regimes": int(en["regimes"].iloc[0]),
        "narrow_line_median": float(en["line"].abs().median()),
        "narrow_piecewise_median": float(en["piecewise"].abs().median()),
    }
    return row, e.assign(name=name)


def _band(err: pd.Series, nbytes: pd.Series, band) -> float:
    """Median signed error of the sizes in band (lo, hi) bytes; NaN when none."""
    pick = (nbytes >= band[0]) & (nbytes <= band[1])
    return float(err[pick].median()) if pick.any() else float("nan")


def busbw_carried(a: pd.DataFrame, b: pd.DataFrame, op: str) -> pd.Series:
    """nccl-tests' premise, busbw independent of the rank count: the time of each size at b's rank count
    predicted from a's time of the same size, t_b = t_a x factor(p_b) / factor(p_a); indexed by nbytes."""
    f = BUS_FACTOR[op]
    pa, pb = int(a["nproc"].iloc[0]), int(b["nproc"].iloc[0])
    both = a.set_index("nbytes")["seconds"].reindex(b["nbytes"])
    return both * f(pb) / f(pa)


def cross(fit_on: str, predict: str, what: str) -> dict:
    """Fit one output's sizes >= 1 MiB, predict another's sizes >= 1 MiB at its own rank count."""
    a, b = public_nccl_tests(fit_on), public_nccl_tests(predict)
    op = op_of(a)
    if op_of(b) != op:
        raise ValueError(f"{fit_on} timed {op}, {predict} timed {op_of(b)}: a cross prediction needs one collective")
    pa, pb = points(a), points(b)
    fit = fitted(a, set(pa.loc[pa["nbytes"] >= MIB, "nbytes"]))
    target = pb[pb["nbytes"] >= MIB].reset_index(drop=True)
    e = errors(fit, target, op)
    carried = busbw_carried(pa, target, op).to_numpy() / target["seconds"].to_numpy() - 1
    carried = pd.Series(carried)
    f = BUS_FACTOR[op]

    def peak(pts):  # peak busbw (GB/s) of the sizes >= 1 MiB
        big = pts[pts["nbytes"] >= MIB]
        return float((big["nbytes"] / big["seconds"] * f(int(big["nproc"].iloc[0]))).max() / 1e9)

    return {
        "fit_on": fit_on,
        "predict": predict,
        "what": what,
        "op": op,
        "gpus": f"{a.meta['world_size']} -> {b.meta['world_size']}",
        "sizes": len(target),
        "line_median": float(e["line"].abs().median()),
        "piecewise_median": float(e["piecewise"].abs().median()),
        "piecewise_worst": float(e["piecewise"].abs().max()),
        "piecewise_bias": float(e["piecewise"].median()),
        "piecewise_small": _band(e["piecewise"], target["nbytes"], SMALL),
        "piecewise_large": _band(e["piecewise"], target["nbytes"], LARGE),
        "carried_sizes": int(carried.notna().sum()),
        "carried_median": float(carried.abs().median()),
        "carried_small": _band(carried, target["nbytes"], SMALL),
        "carried_large": _band(carried, target["nbytes"], LARGE),
        "busbw_fit_on": peak(pa),
        "busbw_predict": peak(pb),
        "outside": sorted(
            {w for w in fit.outside(op, target["nbytes"], int(target["nproc"].iloc[0]), b.meta["nnodes"]) if w}
        ),
    }


def pct(x: float) -> str:
    """A fraction as a percentage with one decimal; a dash where there is no figure."""
    return "-" if x != x else f"{100 * x:.1f} %"


def spct(x: float) -> str:
    """A signed fraction as a percentage with one decimal; a dash where there is no figure."""
    return "-" if x != x else f"{100 * x:+.1f} %"


def markdown(rows: pd.DataFrame, per_regime: pd.Series, crosses: pd.DataFrame) -> str:
    """The tables as docs/benchmarks.md shows them."""
    out = [
        "| output | op | GPUs on nodes | fabric | fit / held-out sizes | regimes | single line: median, worst | "
        "piecewise: median, worst | from the other half alone: regimes, line, piecewise |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows.itertuples():
        out.append(
            f"| `{r.name}` | {r.op.replace('_', '-')} | {r.gpus} on {r.nodes} | {r.fabric} | {r.fit_sizes} / "
            f"{r.held_out} | {r.regimes} | {pct(r.line_median)}, {pct(r.line_worst)} | {pct(r.piecewise_median)}, "
            f"{pct(r.piecewise_worst)} | {r.narrow_regimes}, {pct(r.narrow_line_median)}, "
            f"{pct(r.narrow_piecewise_median)} |"
        )
    n = len(rows)
    out += [
        "",
        f"within 10 %: piecewise {int((rows['piecewise_median'] <= 0.10).sum())} of {n}, single line "
        f"{int((rows['line_median'] <= 0.10).sum())} of {n}; per regime (median |error|):",
        per_regime.to_string(),
        "",
        "| fit on | predict | what changes | GPUs | sizes | single line median | piecewise: median, worst, bias | "
        "piecewise bias 1-32 MiB, >= 256 MiB | busbw carried: median, bias 1-32 MiB, >= 256 MiB | "
        "peak busbw fit on / predicted (GB/s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in crosses.itertuples():
        out.append(
            f"| `{r.fit_on}` | `{r.predict}` | {r.what} | {r.gpus} | {r.sizes} | {pct(r.line_median)} | "
            f"{pct(r.piecewise_median)}, {pct(r.piecewise_worst)}, {spct(r.piecewise_bias)} | "
            f"{spct(r.piecewise_small)}, {spct(r.piecewise_large)} | {pct(r.carried_median)}, "
            f"{spct(r.carried_small)}, {spct(r.carried_large)} | {r.busbw_fit_on:.1f} / {r.busbw_predict:.1f} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--markdown", action="store_true", help="print the tables as docs/benchmarks.md shows them")
    args = ap.parse_args(argv)
    names = list(public_nccl_tests()["name"])
    held = [held_out(n) for n in names]
    rows = pd.DataFrame([h[0] for h in held])
    per_regime = (
        pd.concat([h[1] for h in held]).groupby(["name", "regime"])["piecewise"].agg(lambda x: x.abs().median())
    ).round(3)
    crosses = pd.DataFrame([cross(*c) for c in CROSS])
    if args.markdown:
        print(markdown(rows, per_regime, crosses))
    else:
        with pd.option_context("display.width", 220, "display.max_columns", 30):
            print(rows.round(3).to_string(index=False))
            print(per_regime)
            print(crosses.drop(columns=["outside"]).round(3).to_string(index=False))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"held_out": rows.to_dict("records"), "cross": crosses.to_dict("records")}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
