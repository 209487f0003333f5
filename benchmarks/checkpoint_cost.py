"""Checkpoint cost vs work lost, measured for a few checkpoint intervals N. Not a test: it prints two tables.

For each N (--every; 0 = no checkpoints) one 2-rank gloo run is killed the same way: rank 1 SIGKILLs itself at the
start of step --kill-at (DTLAB_FAULT="1:K:kill"), torchrun restarts the group (--max-restarts 1) and every rank
resumes from the newest complete checkpoint (from step 0 without one). Per N, from the run's own records
(dtlab.model.restarts.measured_costs):

- what checkpointing costs while nothing fails: checkpoints saved, C (median over checkpoints of the slowest rank's
  save time), bytes per checkpoint (all ranks' files), and the total time spent saving;
- what the failure cost: steps redone (recorded by the killed attempt, redone by the restarted one) and their time,
  plus the down time (from each rank's last record before the failure to its resume: torchrun noticing, new
  processes, imports, model build, checkpoint load). lost = redone + down.

Then the first-order model (Young 1974 / Daly 2006) with the measured t_step, C and down time at an assumed MTBF
(--mtbf-h): the expected waste per N and the optimum interval.

    python benchmarks/checkpoint_cost.py --every 1,2,4,8,0 --steps 12 --kill-at 11
"""

import argparse
import os
import statistics
import tempfile

import dtlab
from dtlab.model.restarts import checkpoint_tradeoff, measured_costs


def run_one(every: int, args, root: str):
    """One killed-and-restarted run with checkpoints every `every` steps; returns its Run."""
    os.environ["DTLAB_FAULT"] = f"1:{args.kill_at}:kill"
    common = dict(
        out=os.path.join(root, f"every-{every}"),
        steps=args.steps,
        baseline_steps=0,
        warmup=1,
        checkpoint_every=every,
        max_restarts=1,
    )
    if args.model == "tiny":
        cfg = dtlab.tiny(**common)
    else:  # the README's main job
        cfg = dtlab.RunConfig(model="distilbert", nproc=2, batch_size=8, seq_len=64, **common)
    try:
        return dtlab.run(cfg, progress=False)
    finally:
        os.environ.pop("DTLAB_FAULT", None)


def main() -> None:
    """Run one killed-and-restarted run per N, print what each cost, then the model's table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--every", default="1,2,4,8,0", help="checkpoint intervals N in steps (0: none)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-at", type=int, default=11, help="step at whose start rank 1 is killed")
    ap.add_argument("--model", choices=("tiny", "distilbert"), default="tiny")
    ap.add_argument("--mtbf-h", type=float, default=1.0, help="assumed mean time between failures (hours)")
    ap.add_argument("--out", default=None, help="keep the run directories here (default: a temporary folder)")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="dtlab-ckpt-")
    rows = []
    for every in [int(x) for x in args.every.split(",")]:
        run = run_one(every, args, root)
        c = measured_costs(run)
        assert sorted(run.steps["step"].unique()) == list(range(args.steps)), "a step is missing or doubled"
        saved = run.checkpoints.groupby(["attempt", "step"])["t_save"].max().sum() if c["checkpoints"] else 0.0
        rows.append({"every": every, **c, "save_total_s": float(saved)})
        print(
            f"N={every}: {c['checkpoints']} checkpoints, C {c['checkpoint_s'] * 1e3:.0f} ms, "
            f"{c['lost_steps']} steps redone, down {c['down_s']:.1f} s",
            flush=True,
        )

    print(
        f"\n{args.model}, 2 gloo ranks, {args.steps} steps, rank 1 killed at the start of step {args.kill_at}; "
        f"run directories in {root}"
    )
    print(
        f"{'N':>4} {'ckpts':>5} {'C ms':>7} {'MiB/ckpt':>9} {'saving s':>9} {'redone':>6} {'redone ms':>9} "
        f"{'down s':>7} {'lost s':>7} {'t_step ms':>9}"
    )
    for r in rows:
        c_ms = f"{r['checkpoint_s'] * 1e3:7.0f}" if r["checkpoints"] else f"{'-':>7}"
        mib = f"{r['checkpoint_bytes'] / 2**20:9.1f}" if r["checkpoints"] else f"{'-':>9}"
        print(
            f"{r['every']:>4} {r['checkpoints']:>5} {c_ms} {mib} {r['save_total_s']:9.2f} {r['lost_steps']:>6} "
            f"{r['lost_s'] * 1e3:9.0f} {r['down_s']:7.1f} {r['lost_total_s']:7.1f} {r['t_step'] * 1e3:9.1f}"
        )

    t_step = statistics.median(r["t_step"] for r in rows)
    ck = [r["checkpoint_s"] for r in rows if r["checkpoints"]]
    c = statistics.median(ck) if ck else 0.0
    down = statistics.median(r["down_s"] for r in rows)
    mtbf = args.mtbf_h * 3600.0
    every = sorted({r["every"] for r in rows if r["every"]} | {10, 100, 1000, 10000})
    t = checkpoint_tradeoff(t_step, c, mtbf, every=every, restart_s=down)
    print(
        f"\nmodel: t_step {t_step * 1e3:.1f} ms, C {c * 1e3:.0f} ms, restart {down:.1f} s, MTBF {args.mtbf_h:g} h: "
        f"Young's N* = sqrt(2 C MTBF) / t_step = {t.attrs['young_every']:.0f} steps "
        f"(Daly: {t.attrs['daly_every']:.0f})"
    )
    print(f"{'N':>6} {'interval s':>10} {'saving':>8} {'lost/failure s':>14} {'waste':>8}")
    for r in t.itertuples():
        print(f"{r.every:>6} {r.interval_s:10.2f} {r.save_overhead:8.1%} {r.lost_per_failure_s:14.1f} {r.waste:8.1%}")


if __name__ == "__main__":
    main()
