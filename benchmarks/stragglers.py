"""A straggler example, measured: three workers whose compute takes 1000, 1200 and 1100 ms; every
synchronous step takes the slowest one's 1200 ms, and the others wait 200 and 100 ms.

Runs DDP with `straggler` (default '1:1.2,2:1.1': rank 1's compute x 1.2, rank 2's x 1.1) and prints, per rank,
the medians over the measured steps of its compute (without the injected delay), the delay injected, its
measured wait for the slowest peer (`dtlab.results.stragglers`), the synchronous-step model's wait from the measured
compute (`sync_step_model`) and whom it waited for. Three ranks on a 2-core machine are oversubscribed: every rank's
compute is inflated and noisier than on 3 free cores, which the printout says. Not a test.

    python benchmarks/stragglers.py --model distilbert --steps 8 --html stragglers.html
    python benchmarks/stragglers.py --model tiny --straggler '1:+200ms,2:+100ms'
"""

import argparse
import json
import os
import tempfile

import pandas as pd

import dtlab
from dtlab.results.stragglers import run_waits, sync_step_model, wait_summary
from dtlab.viz.stragglers import who_waited


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="distilbert")
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--straggler", default="1:1.2,2:1.1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    ap.add_argument("--html", default=None, help="write the who-waited-for-whom figure here")
    ap.add_argument("--json", default=None, help="write the per-rank figures here as JSON")
    a = ap.parse_args()
    out = a.out or os.path.join(tempfile.mkdtemp(prefix="dtlab-stragglers-"), "run")
    cfg = dtlab.RunConfig(
        model=a.model,
        nproc=a.nproc,
        steps=a.steps,
        warmup=a.warmup,
        baseline_steps=0,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        model_source="random",
        data="offline",
        device="cpu",
        straggler=a.straggler,
        out=out,
    )
    run = dtlab.run(cfg, progress=False)
    s = wait_summary(run_waits(run))
    model = sync_step_model(dict(zip(s["rank"], s["t_comp_s"]))).set_index("rank")
    print(
        f"{a.model}, {a.nproc} gloo ranks on {run.resolved.get('cpu_cores')} CPU cores"
        + (" (oversubscribed: compute inflated and noisy)" if run.resolved.get("oversubscribed") else "")
        + f", straggler {a.straggler!r}, medians over {int(s['steps'].max())} steps (ms):"
    )
    print(f"{'rank':>4} {'compute':>9} {'delay':>9} {'comp+delay':>11} {'wait':>9} {'model wait':>11}  waited for")
    rows = []
    for r in s.itertuples():
        comp, mw = r.t_comp_s - r.straggle_s, float(model.loc[r.rank, "wait_s"])
        who = "nobody" if pd.isna(r.waited_for) else f"rank {int(r.waited_for)}"
        print(
            f"{r.rank:>4} {comp * 1e3:9.1f} {r.straggle_s * 1e3:9.1f} {r.t_comp_s * 1e3:11.1f} "
            f"{r.wait_s * 1e3:9.1f} {mw * 1e3:11.1f}  {who}"
        )
        rows.append(
            {
                "rank": int(r.rank),
                "compute_s": comp,
                "straggle_s": r.straggle_s,
                "wait_s": r.wait_s,
                "model_wait_s": mw,
                "t_step_s": r.t_step_s,
                "waited_for": who,
            }
        )
    print(f"run directory: {out}")
    if a.html:
        who_waited(run_waits(run), f"{a.model}, {a.nproc} ranks, straggler {a.straggler}").write_html(a.html)
        print(f"figure: {a.html}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"ranks": rows, "args": vars(a), "resolved_straggler": run.resolved.get("straggler")}, f, indent=2
            )


if __name__ == "__main__":
    main()
