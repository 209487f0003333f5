"""Time to accuracy for every convergence lever on this machine: the numbers of docs/convergence.md.

Each lever is one `dtlab run` command (printed before it runs), the tiny model on the generated sentences, 2 ranks
(3 for the asynchronous server: 2 workers), 32 sentences per rank and step, 90 steps, AdamW at lr 3e-3 for 64
sentences per update (DDP's global batch) scaled by the square-root rule for the sentences behind one update
(local SGD and the asynchronous server: 32, so 3e-3 / sqrt(2)), held-out accuracy every 5 steps on the 872 held-out
sentences; every lever from the same seeds. Then a calibration of the
all-reduce prices each lever with the time-to-target model (dtlab.model.convergence). Prints markdown tables:
steps and seconds to the target, T_step, bytes per step, the accuracy curves, the staleness histograms, the
learning-rate rules; writes OUT/convergence.html (dtlab.viz.convergence.convergence_figure of the first seed).

    python benchmarks/convergence.py --out runs/convergence --seeds 0,1
"""

import argparse
import os
import shlex
import subprocess
import sys

import pandas as pd

import dtlab
from dtlab.course.claims.lab09 import steps_or_more
from dtlab.model.convergence import lever_from_run, time_to_target
from dtlab.model.whatif import compute_from_run
from dtlab.results.convergence import bytes_per_step, staleness_histogram, update_interval

BASE = [
    "--model",
    "tiny",
    "--model-source",
    "random",
    "--data",
    "offline",
    "--nproc",
    "2",
    "--steps",
    "90",
    "--warmup",
    "2",
    "--batch-size",
    "32",
    "--seq-len",
    "32",
    "--bucket-mb",
    "0.05",
    "--lr",
    "3e-3",
    "--lr-scaling",
    "sqrt",
    "--base-batch",
    "64",
    "--eval-every",
    "5",
    "--baseline-steps",
    "0",
    "--no-progress",
]
LEVERS = {
    "baseline (DDP)": ["--baseline-steps", "2"],
    "fp16": ["--comm-hook", "fp16"],
    "PowerSGD r=1": ["--comm-hook", "powersgd", "--powersgd-rank", "1"],
    "local SGD H=2": ["--local-sgd", "2"],
    "local SGD H=5": ["--local-sgd", "5"],
    "local SGD H=10": ["--local-sgd", "10"],
    "async, drop > 2": ["--strategy", "async", "--nproc", "3"],
    "async, wait, s=0": ["--strategy", "async", "--nproc", "3", "--staleness-policy", "wait", "--max-staleness", "0"],
}
#: DDP with lr 1.5e-3 tuned for 32 sentences per update, scaled for its 64 (2 ranks x 32), warmed up over 5 steps
LR_RULES = {
    f"lr {rule}": [
        "--baseline-steps",
        "0",
        "--lr",
        "1.5e-3",
        "--lr-scaling",
        rule,
        "--base-batch",
        "32",
        "--warmup-steps",
        "5",
    ]
    for rule in ("none", "linear", "sqrt")
}


def md_table(df: pd.DataFrame, index: bool = False) -> str:
    """A markdown table (pandas' to_markdown needs tabulate, which dtlab does not install)."""
    if index:
        df = df.reset_index()
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join("" if pd.isna(v) else str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def run_lever(out: str, name: str, extra: list, seed: int):
    path = os.path.join(out, f"{name.replace(' ', '_').replace(',', '').replace('>', 'gt').replace('=', '')}-s{seed}")
    cmd = [sys.executable, "-m", "dtlab", "run", *BASE, *extra, "--seed", str(seed), "--out", path]
    print("$ dtlab run " + " ".join(shlex.quote(c) for c in cmd[4:]), flush=True)
    if not os.path.exists(os.path.join(path, "status.json")):
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return dtlab.load_run(path)


def t_step(run) -> float:
    from dtlab.config.strategies import strategy_spec

    if strategy_spec(run.config.strategy).asynchronous:
        return update_interval(run)
    return float(run.summary().set_index("quantity").loc["T_step", "value"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/convergence")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--target", type=float, default=0.9)
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    os.makedirs(a.out, exist_ok=True)
    runs = {(name, s): run_lever(a.out, name, extra, s) for s in seeds for name, extra in LEVERS.items()}
    runs.update({(name, seeds[0]): run_lever(a.out, name, extra, seeds[0]) for name, extra in LR_RULES.items()})
    prof = dtlab.calibrate(
        nproc=2,
        ops=("all_reduce",),
        sizes=[2**k for k in range(14, 24)],
        iters=8,
        out=os.path.join(a.out, "calibration"),
        progress=False,
    )
    fit = prof.fits["all_reduce"]
    print(f"\nall_reduce ({fit.form} form): alpha {fit.alpha * 1e6:.0f} us, 1/beta {1 / fit.beta / 1e9:.2f} GB/s")

    rows = []
    for (name, s), r in runs.items():
        steps, reached = steps_or_more(r, a.target)
        t = r.time_to(a.target)
        row = {
            "lever": name,
            "seed": s,
            f"steps to {a.target:g}": steps if reached else f"> {steps - 5}",
            f"s to {a.target:g}": f"{t:.2f}" if t is not None else "not reached",
            "T_step (ms)": f"{t_step(r) * 1e3:.1f}",
            "bytes per step": f"{bytes_per_step(r):,.0f}",
            "best accuracy": f"{r.evals['accuracy'].max():.3f}",
            "final accuracy": f"{r.evals['accuracy'].iloc[-1]:.3f}",
        }
        rows.append(row)
    print("\n" + md_table(pd.DataFrame(rows)))

    for s in seeds:
        main_runs = {name: runs[(name, s)] for name in LEVERS}
        comp = compute_from_run(main_runs["baseline (DDP)"])
        t_comp = comp["t_fwd"] + comp["t_bwd_comp"] + comp["t_opt"]
        levers = [lever_from_run(k, r, a.target) for k, r in main_runs.items()]
        table = time_to_target(
            levers,
            t_comp=t_comp,
            nbytes=main_runs["baseline (DDP)"].resolved["grad_bytes"],
            nproc=2,
            link=prof,
            t_apply=comp["t_opt"],
        )
        table["measured s"] = [main_runs[k].time_to(a.target) for k in table["label"]]
        table["measured T_step ms"] = [t_step(main_runs[k]) * 1e3 for k in table["label"]]
        print(f"\nseed {s}: the model (T_comp {t_comp * 1e3:.1f} ms from the baseline's no-op steps)\n")
        print(
            md_table(
                table[["label", "steps", "t_step", "time", "measured T_step ms", "measured s"]]
                .assign(
                    t_step=lambda d: (d["t_step"] * 1e3).round(1),
                    time=lambda d: d["time"].round(2),
                    **{
                        "measured T_step ms": lambda d: d["measured T_step ms"].round(1),
                        "measured s": lambda d: d["measured s"].round(2),
                    },
                )
                .rename(columns={"t_step": "model T_step ms", "time": "model s"})
            )
        )
        if s == seeds[0]:
            from dtlab.viz.convergence import convergence_figure

            fig = convergence_figure({k: r.evals for k, r in main_runs.items()}, a.target, table)
            fig.write_html(os.path.join(a.out, "convergence.html"), include_plotlyjs="cdn")

    curve = {}
    for name in list(LEVERS) + list(LR_RULES):
        ev = runs[(name, seeds[0])].evals.set_index("step")["accuracy"]
        curve[name] = ev[ev.index % 10 == 0]
    print(f"\naccuracy every 10 steps (seed {seeds[0]}; async: server updates)\n")
    print(md_table(pd.DataFrame(curve).T.round(2), index=True))
    for (name, s), r in runs.items():
        if not r.updates.empty:
            h = staleness_histogram(r.updates)
            print(
                f"\n{name}, seed {s}: staleness "
                + ", ".join(
                    f"{int(x.staleness)}: {int(x.applied)} applied"
                    + (f" / {int(x.dropped)} dropped" if x.dropped else "")
                    for x in h.itertuples()
                )
            )
    for name in LR_RULES:
        print(f"{name}: {runs[(name, seeds[0])].resolved['lr_rule']}")


if __name__ == "__main__":
    main()
