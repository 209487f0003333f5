r"""Parameter server (reduce to rank 0 + broadcast) vs ring all-reduce on this machine, in two parts.

Part 1 (collectives alone): one calibration launch of max(p) ranks times both ops on the first k ranks for every
k in --nprocs (the others wait at the barrier), at --sizes, interleaved, so every p sees the same machine load.
Prints the median time per (op, p, size), the PS / ring ratio beside the forms' ratios (dtlab.model.ps),
and the alpha-beta fit per (op, p).
Part 2 (real training): `dtlab.sweep(strategy=["ddp", "ps"], nproc=..., bucket_mb=...)`, the same model and data
for both: T_step, T_comm, exposed per point.
Oversubscribed points (more ranks than CPU cores) are flagged in both tables. Figures: OUT/ps_shapes.html and
OUT/ps_vs_ring.html (dtlab.viz.ps).

    python benchmarks/ps_vs_ring.py --nprocs 2,3,4 --sizes 1M,4M,16M,64M --buckets 1,25 --model tiny \
        --out runs/ps_vs_ring
"""

import argparse
import json
import os

import pandas as pd

import dtlab
from dtlab.cli.flags import parse_bytes
from dtlab.model.fit import fit_alpha_beta
from dtlab.model.link import Link
from dtlab.model.ps import forms_table


def collectives(out: str, nprocs: list, sizes: list, iters: int) -> tuple:
    """Part 1: (profile, medians per (p, size) with PS / ring and the forms' ratios, fits per (op, p, form));
    seconds, bytes; alpha in us, 1/beta in GB/s."""
    prof = dtlab.calibrate(
        nproc=max(nprocs),
        group_sizes=tuple(nprocs),
        ops=("all_reduce", "ps"),
        sizes=sizes,
        iters=iters,
        rounds=min(3, iters),
        warmup=2,
        out=os.path.join(out, "calibration"),
        progress=False,
    )
    s = prof.samples
    cores = prof.meta.get("cpu_cores")
    med = s.groupby(["nproc", "nbytes", "op"])["seconds"].median().unstack("op")
    med["ps_over_ring"] = med["ps"] / med["all_reduce"]
    med = med.reset_index()
    forms = forms_table(Link(alpha=0.0, beta=1.0), 1.0, med["nproc"].to_numpy())
    for c in ("ps_over_ring_server", "ps_over_ring_gloo", "ps_over_ring_nccl"):
        med[c.replace("ps_over_ring_", "form_")] = forms[c].to_numpy()
    med["oversubscribed"] = med["nproc"] > (cores or 10**6)
    fits = [
        {
            "op": op,
            "nproc": p,
            "form": form,
            "alpha_us": f.alpha * 1e6,
            "GB_per_s": 1e-9 / f.beta if f.beta > 0 else float("inf"),
            "rel_rms": f.rel_rms,
        }
        for op in ("all_reduce", "ps")
        for p in sorted(s["nproc"].unique())
        for form in ("textbook", "ring")
        for f in [fit_alpha_beta(s[s["nproc"] == p], op, form)]
    ]
    return prof, med, pd.DataFrame(fits)


def training(out: str, model: str, nprocs: list, buckets: list, steps: int) -> pd.DataFrame:
    """Part 2: the sweep table (seconds) of ddp and ps at every (p, bucket MiB), run back to back per point."""
    base = dtlab.RunConfig(
        model=model,
        steps=steps,
        warmup=2,
        baseline_steps=2,
        batch_size=8,
        seq_len=64 if model == "distilbert" else 32,
        model_source="random",
        data="offline",
    )
    return dtlab.sweep(
        base, strategy=["ddp", "ps"], nproc=nprocs, bucket_mb=buckets, out=os.path.join(out, "sweep"), progress=True
    )


def main() -> None:
    """Parse the flags, run both parts, print the tables, write the figures (and --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", default="2,3,4", help="comma list of rank counts p")
    ap.add_argument("--sizes", default="1M,4M,16M,64M", help="message sizes for part 1 (K, M suffixes)")
    ap.add_argument("--iters", type=int, default=6, help="timed samples per (op, p, size)")
    ap.add_argument("--buckets", default="1,25", help="bucket sizes in MiB for part 2")
    ap.add_argument("--model", default="tiny", choices=("tiny", "distilbert"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip-training", action="store_true")
    ap.add_argument("--out", default="runs/ps_vs_ring")
    ap.add_argument("--json", default=None, help="also write the tables here")
    a = ap.parse_args()
    nprocs = [int(x) for x in a.nprocs.split(",")]
    sizes = [parse_bytes(x, "--sizes") for x in a.sizes.split(",")]
    os.makedirs(a.out, exist_ok=True)
    from dtlab.viz.ps import ps_shapes_figure, ps_vs_ring_figure

    prof, med, fits = collectives(a.out, nprocs, sizes, a.iters)
    pd.set_option("display.width", 160)
    print(f"Part 1: collectives, {prof.meta.get('backend')} on {prof.meta.get('cpu_cores')} cores (median ms):")
    show = med.assign(all_reduce=med["all_reduce"] * 1e3, ps=med["ps"] * 1e3, MiB=med["nbytes"] / 2**20)
    print(
        show[
            [
                "nproc",
                "MiB",
                "all_reduce",
                "ps",
                "ps_over_ring",
                "form_server",
                "form_gloo",
                "form_nccl",
                "oversubscribed",
            ]
        ]
        .round(3)
        .to_string(index=False)
    )
    print("\nalpha-beta fit per op and p (form 'ring' is the server link for ps):")
    print(fits.round(3).to_string(index=False))
    ps_shapes_figure(prof.samples, prof.meta.get("cpu_cores")).write_html(os.path.join(a.out, "ps_shapes.html"))
    df = None
    if not a.skip_training:
        df = training(a.out, a.model, nprocs, [float(b) for b in a.buckets.split(",")], a.steps)
        print(f"\nPart 2: training ({a.model}), medians in ms:")
        t = df.assign(**{c: df[c] * 1e3 for c in ("t_step", "t_comp", "t_comm", "exposed")})
        print(
            t[["strategy", "nproc", "bucket_mb", "status", "t_step", "t_comp", "t_comm", "exposed", "oversubscribed"]]
            .round(1)
            .to_string(index=False)
        )
        ps_vs_ring_figure(df).write_html(os.path.join(a.out, "ps_vs_ring.html"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "collectives": med.to_dict("records"),
                    "fits": fits.to_dict("records"),
                    "training": None if df is None else df.to_dict("records"),
                    "caveats": prof.caveats,
                },
                f,
                indent=1,
                default=str,
            )


if __name__ == "__main__":
    main()
