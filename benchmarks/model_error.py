"""The alpha-beta model's prediction error on this machine, to compare later changes against.

Part 1 (collectives): calibrate all_reduce at the default sizes (powers of 2, 4 KiB..64 MiB), then time
plain torch.distributed all-reduce independently (benchmarks/plain_allreduce.py, 3 separate launches, so the
repeatability of the measurement itself is shown) at held-out sizes not in the sweep (3 x 2^k), and report
predicted vs measured for the single full-range fit and for the piecewise (per-regime) fit the profile uses by
default (gloo switches algorithm between 256 KiB and 1 MiB).
Part 2 (DDP steps): real DDP runs over a grid of bucket sizes; `dtlab.predict(run, profile)` median absolute
T_step and T_comm errors per bucket size, for the idle prediction (every bucket at its idle price) and the
contended one (the calibration also timed every size beside a replayed backward pass of the same model and batch,
load='backward': a bucket in flight during backward is priced with that loaded fit, after it with the idle fit).

    python benchmarks/model_error.py --model distilbert --buckets 1,5,25 --steps 6 --json model_error.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import dtlab
from dtlab.launching.torchrun import free_port
from dtlab.model.prediction import prediction_summary

# 3 x 2^k: between the calibration sizes (powers of 2), never equal to one
REPEATS = 3
HELD_OUT = [3 << 13, 3 << 16, 3 << 19, 3 << 21, 3 << 23, 3 << 24]


def held_out_check(root: str, nproc: int, model: str, batch_size: int, seq_len: int, load: str) -> dict:
    prof = dtlab.calibrate(
        nproc=nproc,
        ops=("all_reduce",),
        out=os.path.join(root, "profile"),
        load=load,
        load_model=model,
        load_batch_size=batch_size,
        load_seq_len=seq_len,
        progress=False,
    )

    here = os.path.dirname(os.path.abspath(__file__))
    repeats = {n: [] for n in HELD_OUT}
    for rep in range(REPEATS):  # separate launches: how repeatable is the independent measurement itself?
        out = os.path.join(root, f"plain{rep}.json")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={nproc}",
                "--master-addr=127.0.0.1",
                f"--master-port={free_port()}",
                os.path.join(here, "plain_allreduce.py"),
                out,
                *map(str, HELD_OUT),
            ],
            check=True,
            capture_output=True,
        )
        with open(out) as f:
            for k, v in json.load(f)["median_s"].items():
                repeats[int(k)].append(v)
    measured = {n: float(np.median(v)) for n, v in repeats.items()}
    rows = []
    for n in HELD_OUT:
        single = float(prof.predict("all_reduce", n, nproc, piecewise=False))
        piece = float(prof.predict("all_reduce", n, nproc))
        rows.append(
            {
                "nbytes": n,
                "measured_s": measured[n],
                "repeat_spread": max(repeats[n]) / min(repeats[n]),
                "repeats_s": repeats[n],
                "pred_single_s": single,
                "err_single": single / measured[n] - 1,
                "pred_piecewise_s": piece,
                "err_piecewise": piece / measured[n] - 1,
            }
        )
    regimes = [(sg.min_bytes, sg.max_bytes) for sg in prof.segments.get("all_reduce", [])]
    return {"profile": os.path.join(root, "profile"), "rows": rows, "regimes": regimes}


def ddp_grid(
    root: str, profile_dir: str, model: str, buckets, steps: int, nproc: int, batch_size: int, seq_len: int
) -> list:
    prof = dtlab.load_profile(profile_dir)
    rows = []
    for b in buckets:
        cfg = dtlab.RunConfig(
            model=model,
            nproc=nproc,
            bucket_mb=b,
            steps=steps,
            warmup=1,
            batch_size=batch_size,
            seq_len=seq_len,
            model_source="random",
            data="offline",
            out=os.path.join(root, f"ddp-b{b:g}"),
        )
        run = dtlab.run(cfg, progress=False)
        s = prediction_summary(dtlab.predict(run, prof))
        rows.append(
            {
                "bucket_mb": b,
                **s,
                "n_buckets": int(run.buckets[run.buckets.step == run.buckets.step.max()].groupby("rank").size().max()),
            }
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="distilbert")
    ap.add_argument("--buckets", default="1,5,25")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-ddp", action="store_true", help="part 1 only")
    ap.add_argument(
        "--load",
        default="backward",
        choices=("idle", "backward"),
        help="also time every size issued from inside a replayed backward pass (default), or not",
    )
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dtlab-model-error-")
    part1 = held_out_check(root, a.nproc, a.model, a.batch_size, a.seq_len, a.load)
    print("held-out all-reduce sizes (not in the calibration sweep), plain torch.distributed, medians:")
    print("regimes fitted (bytes):", ", ".join(f"{a:,}..{b:,}" for a, b in part1["regimes"]))
    print(
        f"{'bytes':>12} {'measured ms':>12} {'max/min of':>11} {'one-line ms':>12} {'error':>8} "
        f"{'piecewise ms':>13} {'error':>8}"
    )
    print(f"{'':>12} {f'(median of {REPEATS})':>12} {'repeats':>11}")
    for r in part1["rows"]:
        print(
            f"{r['nbytes']:>12,} {r['measured_s'] * 1e3:12.3f} {r['repeat_spread']:11.2f} "
            f"{r['pred_single_s'] * 1e3:12.3f} {r['err_single']:+8.1%} {r['pred_piecewise_s'] * 1e3:13.3f} "
            f"{r['err_piecewise']:+8.1%}"
        )
    part2 = (
        []
        if a.skip_ddp
        else ddp_grid(
            root,
            part1["profile"],
            a.model,
            [float(x) for x in a.buckets.split(",")],
            a.steps,
            a.nproc,
            a.batch_size,
            a.seq_len,
        )
    )
    if part2:
        print(
            f"\nDDP {a.model}, {a.nproc} ranks, batch {a.batch_size} x {a.seq_len}: dtlab.predict median |error| "
            "per bucket size (idle: every bucket at its idle price; contended: loaded while backward runs)"
        )
    for r in part2:
        print(
            f"  bucket {r['bucket_mb']:>6g} MiB ({r['n_buckets']} buckets), {r['steps']} steps: idle T_step "
            f"{r['median_abs_t_step_error']:.1%} T_comm {r['median_abs_t_comm_error']:.1%}"
            + (
                f" | contended T_step {r['contended_median_abs_t_step_error']:.1%} T_comm "
                f"{r['contended_median_abs_t_comm_error']:.1%}"
                if "contended_median_abs_t_comm_error" in r
                else ""
            )
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"collectives": part1, "ddp": part2, "args": vars(a)}, f, indent=2)


if __name__ == "__main__":
    main()
