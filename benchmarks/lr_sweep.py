"""Which learning rate trains a model from random weights: held-out accuracy for rates x seeds, through dtlab.run.

Each (rate, seed) is one DDP run of `--model` from random weights on dtlab's generated SST-2-format sentences, with
held-out accuracy every `--eval-every` steps (and before the first step and after the last) on the 872 held-out
sentences (full DistilBERT on a CPU: the first 64, as every run does there). Prints a markdown table (the accuracy at
each evaluation, the final training loss, the wall time of the run) and each rate's mean and worst final accuracy;
writes OUT/lr_sweep.json with every number. The rate 'auto' runs with no `lr` set: the default the run resolved.

    python benchmarks/lr_sweep.py --model tiny --rates 3e-4,1e-3,3e-3 --seeds 0,1,2            # 2 gloo ranks, CPU
    python benchmarks/lr_sweep.py --model distilbert --nproc 1                                # one GPU, ~2-3 min

Per model defaults (each flag overrides): tiny, the plain `dtlab run --model tiny --steps 200 --eval-every 50`
(batch 8 per rank, seq_len 128); distilbert 150 steps of batch 16, seq_len 64, rates 2e-5,1e-4,3e-4,1e-3, seeds 0,1.
"""

import argparse
import json
import os
import platform
import time

import dtlab

DEFAULTS = {
    "tiny": dict(steps=200, batch_size=8, seq_len=128, eval_every=50, rates="3e-4,1e-3,3e-3", seeds="0,1,2"),
    "distilbert": dict(steps=150, batch_size=16, seq_len=64, eval_every=50, rates="2e-5,1e-4,3e-4,1e-3", seeds="0,1"),
}


def one_run(a, rate, seed: int) -> dict:
    """Run (or reuse, when OUT already holds it finished) one rate and seed; its numbers."""
    path = os.path.join(a.out, f"{a.model}-lr{rate}-s{seed}")
    fields = dict(
        model=a.model,
        model_source="random",
        data="offline",
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        eval_every=a.eval_every,
        seed=seed,
        out=path,
    )
    if rate != "auto":
        fields["lr"] = float(rate)
    for name in ("nproc", "device", "baseline_steps"):
        if getattr(a, name) is not None:
            fields[name] = getattr(a, name)
    cfg = dtlab.RunConfig(**fields)
    t0 = time.perf_counter()
    reused = (
        os.path.exists(os.path.join(path, "status.json")) and dtlab.load_run(path).status.get("state") == "finished"
    )
    run = dtlab.load_run(path) if reused else dtlab.run(cfg, progress=False)
    wall = time.perf_counter() - t0
    ev = run.evals
    steps = run.steps
    last = steps[steps["step"] >= steps["step"].max() - 9].groupby("step")["loss"].mean()
    lr = run.resolved.get("lr", {})
    return {
        "rate": rate,
        "lr": lr.get("value", cfg.lr),
        "lr_source": lr.get("source", "explicit"),
        "seed": seed,
        "accuracy": {int(r.step): float(r.accuracy) for r in ev.itertuples()},
        "heldout_loss": {int(r.step): float(r.loss) for r in ev.itertuples()},
        "final_accuracy": float(ev["accuracy"].iloc[-1]),
        "best_accuracy": float(ev["accuracy"].max()),
        "final_train_loss": float(last.mean()),
        "eval_sentences": int(ev["n"].iloc[-1]),
        "wall_s": None if reused else wall,
        "path": path,
        "world_size": run.nproc,
        "device": run.resolved.get("devices"),
        "model_source": run.resolved.get("model_source"),
        "tokenizer_source": run.resolved.get("tokenizer_source"),
        "data_source": run.resolved.get("data_source"),
    }


def table(rows: list, eval_steps: list) -> str:
    cols = ["rate", "seed"] + [f"acc @ {s}" for s in eval_steps] + ["final train loss", "wall s"]
    out = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for r in rows:
        cells = [r["rate"] if r["rate"] != "auto" else f"auto ({r['lr']:g})", str(r["seed"])]
        cells += [f"{r['accuracy'].get(s, float('nan')):.3f}" for s in eval_steps]
        cells += [f"{r['final_train_loss']:.3f}", f"{r['wall_s']:.1f}" if r["wall_s"] is not None else "reused"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(DEFAULTS), default="tiny")
    ap.add_argument("--rates", help="comma-separated learning rates; 'auto' = no lr set (the resolved default)")
    ap.add_argument("--seeds", help="comma-separated seeds")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--nproc", type=int, help="ranks (default: RunConfig's, one per GPU and at least 2)")
    ap.add_argument("--device", help="'auto', 'cuda' or 'cpu' (default: RunConfig's)")
    ap.add_argument(
        "--baseline-steps", type=int, help="no-op comm hook steps after the timed ones (default: RunConfig's)"
    )
    ap.add_argument("--out", help="folder for the runs and lr_sweep.json (default: runs/lr_sweep-MODEL)")
    a = ap.parse_args()
    for k, v in DEFAULTS[a.model].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.out = a.out or f"runs/lr_sweep-{a.model}"
    os.makedirs(a.out, exist_ok=True)
    rates = [r.strip() for r in a.rates.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    print(
        f"{a.model} from random weights: {a.steps} steps of batch {a.batch_size} per rank, seq_len {a.seq_len}, "
        f"held-out accuracy every {a.eval_every} steps; rates {', '.join(rates)} x seeds {seeds}",
        flush=True,
    )
    t0 = time.perf_counter()
    rows = []
    for rate in rates:
        for seed in seeds:
            rows.append(one_run(a, rate, seed))
            r = rows[-1]
            print(
                f"  lr {rate} seed {seed}: accuracy "
                + " ".join(f"{v:.3f}" for v in r["accuracy"].values())
                + f", final train loss {r['final_train_loss']:.3f}"
                + (f", {r['wall_s']:.1f} s" if r["wall_s"] is not None else " (reused)"),
                flush=True,
            )
    total = time.perf_counter() - t0
    eval_steps = sorted({s for r in rows for s in r["accuracy"]})
    print("\n" + table(rows, eval_steps))
    print("\n| rate | mean final accuracy | worst final accuracy | mean final train loss |\n| --- | --- | --- | --- |")
    summary = {}
    for rate in rates:
        mine = [r for r in rows if r["rate"] == rate]
        acc = [r["final_accuracy"] for r in mine]
        summary[rate] = {
            "mean_final_accuracy": sum(acc) / len(acc),
            "worst_final_accuracy": min(acc),
            "mean_final_train_loss": sum(r["final_train_loss"] for r in mine) / len(mine),
        }
        s = summary[rate]
        print(
            f"| {rate} | {s['mean_final_accuracy']:.3f} | {s['worst_final_accuracy']:.3f} | "
            f"{s['mean_final_train_loss']:.3f} |"
        )
    first = rows[0]
    print(
        f"\n{len(rows)} runs in {total:.0f} s on {first['device']} ({first['world_size']} ranks); "
        f"tokenizer: {first['tokenizer_source']}; held-out sentences per evaluation: {first['eval_sentences']}"
    )
    doc = {
        "model": a.model,
        "steps": a.steps,
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "eval_every": a.eval_every,
        "rates": rates,
        "seeds": seeds,
        "total_wall_s": total,
        "host": platform.node(),
        "runs": rows,
        "summary": summary,
    }
    with open(os.path.join(a.out, "lr_sweep.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'lr_sweep.json')}")


if __name__ == "__main__":
    main()
