"""Recorder overhead: instrumented DDP (recording comm hook) vs plain DDP (built-in all-reduce), same config.

Runs are interleaved (plain, recorded, plain, recorded, ...) so drift in the machine's speed hits both
alike; each run's measured steps are reduced to the median slowest-rank step time, and the overhead is
median(recorded) / median(plain) - 1. Not a test: it prints figures for the docs.

    python benchmarks/recorder_overhead.py --pairs 3 --model distilbert --steps 6
"""

import argparse
import json
import os
import statistics
import tempfile

import dtlab


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--model", default="distilbert")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--json", default=None, help="write the figures here as JSON")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dtlab-overhead-")
    times = {"plain": [], "recorded": []}
    for i in range(a.pairs):
        for kind in ("plain", "recorded"):
            cfg = dtlab.RunConfig(
                model=a.model,
                nproc=a.nproc,
                steps=a.steps,
                warmup=1,
                batch_size=a.batch_size,
                seq_len=a.seq_len,
                bucket_mb=a.bucket_mb,
                model_source="random",
                data="offline",
                record=(kind == "recorded"),
                out=os.path.join(root, f"{kind}{i}"),
            )
            run = dtlab.run(cfg, progress=False)
            t = float(run.per_step()["t_step"].median())
            times[kind].append(t)
            print(f"pair {i} {kind:9s} median T_step {t * 1e3:9.1f} ms")
    plain, rec = statistics.median(times["plain"]), statistics.median(times["recorded"])
    overhead = rec / plain - 1
    print(
        f"\nmedian T_step plain {plain * 1e3:.1f} ms, recorded {rec * 1e3:.1f} ms: overhead {overhead:+.2%}"
        f" ({a.pairs} interleaved pairs, {a.model}, {a.nproc} ranks, bucket {a.bucket_mb} MiB)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"plain_s": times["plain"], "recorded_s": times["recorded"], "overhead": overhead, "args": vars(a)},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
