"""The alpha-beta model against real clusters' nccl-tests output: fit on part of each shipped output, predict the
rest, and report the error (docs/benchmarks.md, "The model against real clusters").

- held-out sizes: on every shipped output, hold out every other size of 1 MiB and more and predict them from
  the rest of the output (every size below 1 MiB and the other half above), and from the other half alone; the
  single alpha-beta line (what dtlab fitted before regimes were chosen from the data) beside the piecewise fit
  (dtlab.model.fit.fit_piecewise, up to 5 regimes by BIC, at least 4 sizes each);
- other GPU counts: the same box at 2 and 4 GPUs (fit at one, predict the other, both ways);
- other node counts: one node to two (fit 1 x 8, predict 2 x 8) and the reverse, and 2 x 1 to 2 x 4 on one network.

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

MIB = 2**20
#: (fit on, predict, what changes): the pairs the shipped outputs allow
CROSS = [
    ("rtx4090-pcie-1x2", "rtx4090-pcie-1x4", "GPU count 2 -> 4, one PCIe box"),
    ("rtx4090-pcie-1x4", "rtx4090-pcie-1x2", "GPU count 4 -> 2, one PCIe box"),
    ("aws-p5-1x8-h100-nvswitch", "aws-p5-2x8-h100-efa", "1 node -> 2 nodes (p5, EFA)"),
    ("aws-p5-2x8-h100-efa", "aws-p5-1x8-h100-nvswitch", "2 nodes -> 1 node (p5)"),
    ("cscs-alps-gh200-2x1-slingshot", "cscs-alps-gh200-2x4-slingshot", "2 x 1 -> 2 x 4 GPUs (Alps, Slingshot)"),
    ("cscs-alps-gh200-2x4-slingshot", "cscs-alps-gh200-2x1-slingshot", "2 x 4 -> 2 x 1 GPUs (Alps, Slingshot)"),
]


def points(profile: Profile) -> pd.DataFrame:
    """One row per size: nbytes, nproc, measured seconds (median of the two columns)."""
    s = profile.samples
    return s.groupby(["nbytes", "nproc"])["seconds"].median().reset_index()


def fitted(profile: Profile, keep) -> Profile:
    """A Profile fitted on the samples whose nbytes are in `keep`."""
    s = profile.samples[profile.samples["nbytes"].isin(keep)]
    return Profile.from_samples(s, meta=profile.meta, max_segments=MAX_SEGMENTS)


def errors(fit: Profile, pts: pd.DataFrame, op: str = "all_reduce") -> pd.DataFrame:
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
    pts = points(prof)
    big = pts[pts["nbytes"] >= MIB].reset_index(drop=True)
    train, test = big.iloc[::2], big.iloc[1::2]
    fit = fitted(prof, set(pts["nbytes"]) - set(test["nbytes"]))
    narrow = fitted(prof, set(train["nbytes"]))
    e, en = errors(fit, test), errors(narrow, test)
    row = {
        "name": name,
        "gpus": prof.meta["world_size"],
        "nodes": prof.meta["nnodes"],
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


def cross(fit_on: str, predict: str, what: str) -> dict:
    """Fit one output's sizes >= 1 MiB, predict another's sizes >= 1 MiB at its own rank count."""
    a, b = public_nccl_tests(fit_on), public_nccl_tests(predict)
    pa, pb = points(a), points(b)
    fit = fitted(a, set(pa.loc[pa["nbytes"] >= MIB, "nbytes"]))
    target = pb[pb["nbytes"] >= MIB]
    e = errors(fit, target)
    busbw = lambda prof, pts: float(  # noqa: E731 - peak busbw (GB/s) of the sizes >= 1 MiB
        (pts["nbytes"] / pts["seconds"] * 2 * (pts["nproc"] - 1) / pts["nproc"]).max() / 1e9
    )
    return {
        "fit_on": fit_on,
        "predict": predict,
        "what": what,
        "sizes": len(target),
        "line_median": float(e["line"].abs().median()),
        "piecewise_median": float(e["piecewise"].abs().median()),
        "piecewise_worst": float(e["piecewise"].abs().max()),
        "piecewise_bias": float(e["piecewise"].median()),
        "busbw_fit_on": busbw(a, pa[pa["nbytes"] >= MIB]),
        "busbw_predict": busbw(b, target),
        "outside": sorted(
            {
                w
                for w in fit.outside("all_reduce", target["nbytes"], int(target["nproc"].iloc[0]), b.meta["nnodes"])
                if w
            }
        ),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--markdown", action="store_true", help="print the tables as docs/benchmarks.md shows them")
    args = ap.parse_args(argv)
    names = list(public_nccl_tests()["name"])
    held = [held_out(n) for n in names]
    rows = pd.DataFrame([h[0] for h in held])
    per_regime = pd.concat([h[1] for h in held])
    crosses = pd.DataFrame([cross(*c) for c in CROSS])
    pct = lambda x: f"{100 * x:.1f} %"  # noqa: E731
    if args.markdown:
        print(
            "| output | GPUs on nodes | fit / held-out sizes | regimes | single line: median, worst | "
            "piecewise: median, worst | from the other half alone: regimes, line, piecewise |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows.itertuples():
            print(
                f"| `{r.name}` | {r.gpus} on {r.nodes} | {r.fit_sizes} / {r.held_out} | {r.regimes} | "
                f"{pct(r.line_median)}, {pct(r.line_worst)} | {pct(r.piecewise_median)}, {pct(r.piecewise_worst)} | "
                f"{r.narrow_regimes}, {pct(r.narrow_line_median)}, {pct(r.narrow_piecewise_median)} |"
            )
        print(
            f"\nwithin 10 %: piecewise {int((rows['piecewise_median'] <= 0.10).sum())} of {len(rows)}, single line "
            f"{int((rows['line_median'] <= 0.10).sum())} of {len(rows)}; per regime (median |error|):"
        )
        print(per_regime.groupby(["name", "regime"])["piecewise"].agg(lambda x: x.abs().median()).round(3).to_string())
        print()
        print(
            "| fit on | predict | what changes | sizes | single line median | piecewise: median, worst, bias | "
            "peak busbw fit on / predicted (GB/s) |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in crosses.itertuples():
            print(
                f"| `{r.fit_on}` | `{r.predict}` | {r.what} | {r.sizes} | {pct(r.line_median)} | "
                f"{pct(r.piecewise_median)}, {pct(r.piecewise_worst)}, {r.piecewise_bias:+.1%} | "
                f"{r.busbw_fit_on:.1f} / {r.busbw_predict:.1f} |"
            )
    else:
        with pd.option_context("display.width", 200, "display.max_columns", 20):
            print(rows.round(3).to_string(index=False))
            print(per_regime.groupby(["name", "regime"])["piecewise"].agg(lambda x: x.abs().median()).round(3))
            print(crosses.drop(columns=["outside"]).round(3).to_string(index=False))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"held_out": rows.to_dict("records"), "cross": crosses.to_dict("records")}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
