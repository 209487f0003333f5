"""The what-if DDP step model against real runs: predicted T_step beside measured, over bucket caps, rank counts and
an emulated slow link, every figure with its spread over repeats.

`dtlab.model.whatif.whatif` predicts a DDP step at any bucket cap and rank count from ONE base run (its no-op hook
baseline steps: per-rank forward, backward and optimizer seconds) and a calibrated profile (alpha, beta). This
script measures how far off that is:

- every grid cell run in rounds, round-robin (each round runs every configuration once, in the same order), so
  drift in the machine's load hits all alike; every run records how busy the machine was (dtlab.results.busy);
- the base cell (2 ranks, 25 MiB, with more no-op hook steps) of every round feeds the what-if, so each cell gets
  one prediction per base: the prediction's own spread (the base cell is also predicted, from every base);
- cells: 2 ranks at every cap; 3 ranks (more ranks than the 2 cores: oversubscribed) and 1 rank (no
  communication) at some caps; 2 emulated nodes x 1 rank over a tc-shaped link (dtlab.launching.emulate, needs
  root and network namespaces: skipped with the reason otherwise), priced with a profile calibrated across it;
- OMP_NUM_THREADS=1 for every run: one torch thread per rank at every rank count (dtlab's default would give a
  lone rank both cores), so per-rank compute is comparable across p;
- error = (predicted - measured) / measured of the medians; "outside the noise" when the predicted median lies
  outside the measured runs' min..max; "own compute": the same model fed with each run's own no-op hook compute,
  which cancels the drift between the base run and that run and leaves the communication model;
- model variants (VARIANTS): "before" is the what-if as lab 03 called it (alpha, beta, form); the others add what
  the base run measured: cpu (compute scaled by the fair share of the cores), load (its other processes' load in
  that share), ready (its readiness curve), contention (a loaded calibration's price during backward), wait
  (its exposed communication beyond the queue, dtlab.model.whatif.measured_wait), stretch (backward seconds lost
  per second of communication in flight, from the loaded calibration of the transport the cell runs on: loopback,
  or across the link) and alone (a rank's compute alone against beside the other, from the loopback calibration;
  dtlab.model.sharing).

The what-if check (the documented call, `run.whatif`): `--check` runs only the 2-rank cells (1, 5, 25 and 100 MiB)
and prints, round by round, each round's 25 MiB run predicting that round's other caps (single runs), through the
variant "run.whatif": `base_run.whatif(profile, nproc=2, bucket_mb=cap)`.

    python benchmarks/whatif_error.py --check --rounds 2 --variant before,run.whatif
    python benchmarks/whatif_error.py --rounds 3 --out /tmp/whatif-error --json whatif_error.json
    python benchmarks/whatif_error.py --quick            # tiny model, a smoke test of the script (about 1 min)
    python benchmarks/whatif_error.py --from /tmp/whatif-error   # re-evaluate the model on recorded runs
    python benchmarks/whatif_error.py --from /tmp/run-a,/tmp/run-b   # several recorded runs, repeats pooled
"""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import dtlab
from dtlab.config.calibration import CalibConfig
from dtlab.launching.emulate import Emulation, EmulationUnavailable, shaping_unavailable
from dtlab.model import whatif as wi
from dtlab.model.link import Link, contention_from_profile
from dtlab.model.sharing import stretch_from_profile
from dtlab.results.busy import machine_load

LAYOUTS = {  # name -> (nproc per node, nnodes, emulated link)
    "p1": (1, 1, False),
    "p2": (2, 1, False),
    "p3": (3, 1, False),
    "link": (1, 2, True),
}


def grid(quick: bool, check: bool = False) -> list[tuple[str, float]]:
    """(layout, cap MiB) of every cell, in the order a round runs them; ("p2", base cap) is the base. `check`: the
    what-if check's cells only, 2 ranks at every cap."""
    if check:
        return [("p2", c) for c in ((0.01, 0.05, 1.0) if quick else (1.0, 5.0, 25.0, 100.0))]
    if quick:
        return [("p2", 0.01), ("p2", 0.05), ("p2", 1.0), ("p3", 0.05), ("p1", 0.05), ("link", 0.05)]
    return [("p2", c) for c in (1.0, 5.0, 25.0, 100.0)] + [("p3", 25.0), ("p1", 25.0), ("link", 5.0), ("link", 25.0)]


def base_config(a, layout: str, cap: float, rnd: int, root: str) -> dtlab.RunConfig:
    nproc, nnodes, _ = LAYOUTS[layout]
    is_base = layout == "p2" and cap == a.base_cap
    return dtlab.RunConfig(
        model=a.model,
        nproc=nproc,
        bucket_mb=float(cap),
        steps=a.steps,
        warmup=1,
        baseline_steps=a.base_baseline if is_base else a.baseline,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        model_source="random",
        data="offline",
        timeout_s=900.0,
        out=os.path.join(root, f"r{rnd}-{layout}-b{cap:g}"),
    )


def calibrate_all(a, root: str, em) -> dict:
    """Profiles: loopback between 2 ranks of this node, and across the emulated link (when there is one)."""
    sizes = tuple(1 << k for k in range(12, 23 if a.quick else 27))
    out = {}
    t0 = time.time()
    out["loopback"] = dtlab.calibrate(
        nproc=2,
        ops=("all_reduce",),
        sizes=sizes,
        iters=4 if a.quick else 10,
        out=os.path.join(root, "profile"),
        load="backward",  # as lab 03 calibrates: also each size beside a replayed backward pass (contention)
        load_model=a.model,
        load_batch_size=a.batch_size,
        load_seq_len=a.seq_len,
        progress=False,
    )
    print(f"calibrated loopback in {time.time() - t0:.0f} s", flush=True)
    if em is not None:
        t0 = time.time()
        cfg = CalibConfig(
            nproc=1,
            sizes=sizes,
            iters=4 if a.quick else 6,
            rounds=2,
            out=os.path.join(root, "profile-link"),
            load="backward",  # what the link's transfers cost the backward pass beside them (dtlab.model.sharing)
            load_model=a.model,
            load_batch_size=a.batch_size,
            load_seq_len=a.seq_len,
        )
        out["link"] = em.calibrate(cfg, progress=False)
        print(f"calibrated the emulated link in {time.time() - t0:.0f} s", flush=True)
    return out


def measure(a, root: str) -> None:
    """Calibrate, then run every configuration once per round, round-robin; record what ran in root/runs.json."""
    os.environ["OMP_NUM_THREADS"] = "1"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: still remove the emulated link (finally)
    cells = grid(a.quick, a.check)
    wants_link = any(c[0] == "link" for c in cells)
    why_no_link = shaping_unavailable() if wants_link else None
    em = None
    if wants_link and why_no_link is None:
        try:
            em = Emulation(2, rate=a.rate).__enter__()
        except EmulationUnavailable as e:
            why_no_link = e.reason
    if why_no_link:
        print(f"emulated link skipped: {why_no_link}")
        cells = [c for c in cells if c[0] != "link"]
    order = cells
    record = {"args": vars(a), "order": order, "skipped_link": why_no_link, "runs": []}
    try:
        calibrate_all(a, root, em)
        for rnd in range(a.rounds):
            for layout, cap in order:
                cfg = base_config(a, layout, cap, rnd, root)
                t0 = time.time()
                if layout == "link":
                    cfg = cfg.replace(out=None)
                    cfg = em.prepare(cfg, os.path.join(root, f"r{rnd}-link-b{cap:g}"))
                    run = em.run(cfg, progress=False)
                else:
                    run = dtlab.run(cfg, progress=False)
                wall = time.time() - t0
                print(f"round {rnd}: {layout} {cap:g} MiB: {wall:.0f} s, {run.path}", flush=True)
                record["runs"].append({"round": rnd, "layout": layout, "cap": cap, "path": run.path, "wall_s": wall})
                with open(os.path.join(root, "runs.json"), "w") as f:
                    json.dump(record, f, indent=2)
    finally:
        if em is not None:
            em.close()


def run_figures(run) -> dict:
    """One run's medians (s): T_step, T_comp, exposed (T_step - T_comp of the medians), T_comm, the compute parts
    of its baseline steps, the steady step's bucket count and the last bucket's tail (its end minus backward's end
    on the slowest rank), and the machine's load."""
    s = run.summary().set_index("quantity")["value"]
    st = run.measured_steps()
    slow = st.loc[st.groupby("step")["t_step"].idxmax()]
    b = run.buckets[run.buckets["step"].isin(slow["step"])]
    tails, nb = [], []
    for row in slow.itertuples():
        mine = b[(b["rank"] == row.rank) & (b["step"] == row.step)]
        if not mine.empty:
            nb.append(len(mine))
            tails.append(float(mine["t_end"].max()) - float(mine["t_ready"].max()))
    comp = wi.compute_from_run(run) if run.baseline_steps is not None and not run.baseline_steps.empty else {}
    load = machine_load(run) or {}
    return {
        "t_step": float(s["T_step"]),
        "t_comp": float(s["T_comp"]),
        "exposed": float(s["T_step"] - s["T_comp"]),
        "t_comm": float(s["T_comm"]),
        "t_fwd": comp.get("t_fwd"),
        "t_bwd": comp.get("t_bwd_comp"),
        "t_opt": comp.get("t_opt"),
        "n_buckets": int(np.median(nb)) if nb else 0,
        "tail": float(np.median(tails)) if tails else 0.0,
        "other_cores": load.get("other_cores"),
        "loadavg": (load.get("loadavg_start") or [None])[0],
    }


def spread(values) -> dict:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return {"median": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    return {"median": float(np.median(v)), "lo": float(v.min()), "hi": float(v.max()), "n": int(v.size)}


def base_inputs(run, profile) -> dict:
    """What the what-if takes from a base run: compute (dtlab.model.whatif.compute_from_run), gradient sizes in
    DDP's ready order, other processes' load while it ran (cores' worth, dtlab.results.busy) and its measured wait
    (dtlab.model.whatif.measured_wait with the profile's fit)."""
    load = machine_load(run) or {}
    link = Link.from_profile(profile)
    compute = wi.compute_from_run(run)
    return {
        "run": run,
        "compute": compute,
        "sizes": list(reversed(run.resolved["param_nbytes"])),
        "other_cores": float(load.get("other_cores") or 0.0),
        "wait": wi.measured_wait(run, link.replace(stretch=0.0), compute)["wait"],
        # the wait beyond a model that also stretches backward by the communication beside it
        "wait_stretch": wi.measured_wait(run, link, compute)["wait"],
        "alone": (profile.meta.get("load") or {}).get("alone"),
    }


#: The model variants compared: what each adds to whatif's inputs (the first is lab 03's call before the fixes).
VARIANTS = {
    "before": (),
    "cpu": ("cpu",),
    "cpu+ready": ("cpu", "ready"),
    "cpu+ready+contention": ("cpu", "ready", "contention"),
    "cpu+load+ready": ("cpu", "load", "ready"),
    "cpu+load+ready+contention": ("cpu", "load", "ready", "contention"),
    "cpu+ready+wait": ("cpu", "ready", "wait"),
    "cpu+load+ready+wait": ("cpu", "load", "ready", "wait"),
    "cpu+load+ready+contention+wait": ("cpu", "load", "ready", "contention", "wait"),
    "cpu+load+ready+stretch+wait": ("cpu", "load", "ready", "stretch", "wait"),
    "cpu+alone+load+ready+wait": ("cpu", "alone", "load", "ready", "wait"),
    "cpu+alone+load+ready+stretch+wait": ("cpu", "alone", "load", "ready", "stretch", "wait"),
    # the documented call, run.whatif(profile, nproc=, nodes=, bucket_mb=): everything above, and the contention
    # of the profile's loaded fit, gathered by dtlab.results.whatif
    "run.whatif": (),
}


def predict_cell(base: dict, profile, layout: str, cap: float, variant: str, loaded=None) -> dict:
    """One what-if prediction of a cell from one base run, with what `variant` adds (VARIANTS): cpu (compute scaled
    to the rank count on the shared cores), load (the base run's other load in that scaling), ready (the base run's
    readiness curve), contention (a bucket in flight during backward priced by the loaded fit of `loaded`, or of the
    profile, where it has one). Every variant prices buckets with the profile's single full-range fit, as lab 03
    does."""
    nproc, nnodes, _ = LAYOUTS[layout]
    p = nproc * nnodes
    if variant == "run.whatif":
        r = dict(base["run"].whatif(profile, nproc=nproc, nodes=nnodes, bucket_mb=cap).detail)
        r["tail"] = r["t_comm_end"] - (r["t_comp"] - r["t_opt"]) if r["n_buckets"] else 0.0
        return r
    c, adds = base["compute"], VARIANTS[variant]
    fit = profile.fits["all_reduce"]
    kw, link = {}, {"alpha": max(0.0, fit.alpha), "beta": fit.beta, "form": fit.form}
    if "cpu" in adds and "cpu" in c:
        kw["cpu"] = dict(c["cpu"], other_cores=base["other_cores"] if "load" in adds else 0.0)
        if "alone" in adds and base.get("alone"):
            kw["cpu"]["alone"] = base["alone"]
    if "ready" in adds and "ready_curve" in c:
        kw["ready_curve"] = c["ready_curve"]
    if "contention" in adds and p > 1:
        link["contention"] = contention_from_profile(loaded or profile, 25 * 2**20, 2)[0]
    if "wait" in adds:
        kw["wait"] = base["wait_stretch" if "stretch" in adds else "wait"]
    if "stretch" in adds:
        link["stretch"] = stretch_from_profile(profile)[0]
    r = wi.whatif(c["t_fwd"], c["t_bwd_comp"], c["t_opt"], base["sizes"], cap, p, Link(**link), **kw)
    r["tail"] = r["t_comm_end"] - (r["t_comp"] - r["t_opt"]) if r["n_buckets"] else 0.0  # after backward ends
    return r


def evaluate(roots, variant: str) -> dict:
    """Every cell's measured and predicted figures from the runs recorded under `roots` (a folder, or several:
    their repeats pooled, each folder's runs predicted from its own base runs and calibrations)."""
    roots = [roots] if isinstance(roots, str) else list(roots)
    pooled, order, runs, skipped = {}, [], [], None
    for root in roots:
        got = _recorded(root, variant)
        for cell, lists in got["cells"].items():
            if cell not in pooled:
                order.append(cell)
                pooled[cell] = ([], [], [])
            for into, more in zip(pooled[cell], lists):
                into.extend(more)
        runs += got["runs"]
        skipped = skipped or got["skipped_link"]
    cells = [cell_row(layout, cap, *pooled[(layout, cap)]) for layout, cap in order]
    return {"cells": cells, "runs": runs, "skipped_link": skipped, "roots": roots}


def _recorded(root: str, variant: str) -> dict:
    """One folder's runs: {(layout, cap): (measured runs, predictions from its base runs, own-compute
    predictions)}, its runs and why the link was skipped."""
    with open(os.path.join(root, "runs.json")) as f:
        rec = json.load(f)
    profiles = {"loopback": dtlab.load_profile(os.path.join(root, "profile"))}
    if not profiles["loopback"].has_load("all_reduce") and os.path.exists(os.path.join(root, "profile-loaded")):
        profiles["loaded"] = dtlab.load_profile(os.path.join(root, "profile-loaded"))  # calibrated after the runs
    if os.path.exists(os.path.join(root, "profile-link", "profile.json")):
        profiles["link"] = dtlab.load_profile(os.path.join(root, "profile-link"))
    runs = [dict(r, figs=run_figures(dtlab.load_run(r["path"]))) for r in rec["runs"]]
    base_cap = rec["args"]["base_cap"]
    base_runs = [dtlab.load_run(r["path"]) for r in rec["runs"] if (r["layout"], r["cap"]) == ("p2", base_cap)]
    bases = [base_inputs(run, profiles["loopback"]) for run in base_runs]
    wait = float(np.median([b["wait"] for b in bases]))
    wait_stretch = float(np.median([b["wait_stretch"] for b in bases]))
    cells = {}
    for layout, cap in [tuple(c) for c in rec["order"]]:
        mine = [r for r in runs if r["layout"] == layout and r["cap"] == cap]
        if not mine:
            continue
        prof = profiles["link" if layout == "link" else "loopback"]
        loaded = profiles.get("loaded", prof)
        preds = [predict_cell(b, prof, layout, cap, variant, loaded) for b in bases]
        # the same model fed with each run's own no-op hook compute (and the bases' median wait): drift in the
        # machine's load between the base run and this one cancels, what is left is the model's communication
        own = [
            predict_cell(
                dict(base_inputs(dtlab.load_run(r["path"]), prof), wait=wait, wait_stretch=wait_stretch),
                prof,
                layout,
                cap,
                variant,
                loaded,
            )
            for r in mine
        ]
        cells[(layout, float(cap))] = (mine, preds, own)
    per_run = [{k: r[k] for k in ("round", "layout", "cap", "path", "wall_s", "figs")} for r in runs]  # load per run
    return {"cells": cells, "runs": per_run, "skipped_link": rec.get("skipped_link")}


def cell_row(layout: str, cap: float, mine: list, preds: list, own: list) -> dict:
    keys = ("t_step", "t_comp", "exposed", "t_comm", "tail", "n_buckets")
    m = {k: spread([r["figs"][k] for r in mine]) for k in keys}
    p = {k: spread([r[k] for r in preds]) for k in keys}
    o = {k: spread([r[k] for r in own]) for k in keys}
    err = p["t_step"]["median"] / m["t_step"]["median"] - 1
    return {
        "own": o,
        "own_error": o["t_step"]["median"] / m["t_step"]["median"] - 1,
        "own_outside_noise": not (m["t_step"]["lo"] <= o["t_step"]["median"] <= m["t_step"]["hi"]),
        "layout": layout,
        "cap_mib": cap,
        "measured": m,
        "predicted": p,
        "error": err,
        "measured_halfspread": (m["t_step"]["hi"] - m["t_step"]["lo"]) / 2 / m["t_step"]["median"],
        "outside_noise": not (m["t_step"]["lo"] <= p["t_step"]["median"] <= m["t_step"]["hi"]),
        "comp_error": p["t_comp"]["median"] / m["t_comp"]["median"] - 1,
        "other_cores": spread([r["figs"]["other_cores"] for r in mine]),
        "loadavg": spread([r["figs"]["loadavg"] for r in mine]),
    }


def check_rounds(root: str, variant: str) -> list[dict]:
    """The what-if check, single runs: in each round, that round's base run (2 ranks at the base cap) predicts that
    round's runs at the other caps, one run each; error = (predicted - measured) / measured T_step (median over
    its measured steps, slowest rank)."""
    with open(os.path.join(root, "runs.json")) as f:
        rec = json.load(f)
    profile = dtlab.load_profile(os.path.join(root, "profile"))
    base_cap, rows = rec["args"]["base_cap"], []
    for rnd in sorted({r["round"] for r in rec["runs"]}):
        mine = [r for r in rec["runs"] if r["round"] == rnd and r["layout"] == "p2"]
        base = [r for r in mine if r["cap"] == base_cap]
        if not base:
            continue
        b = base_inputs(dtlab.load_run(base[0]["path"]), profile)
        for r in mine:
            if r["cap"] == base_cap:
                continue
            measured = run_figures(dtlab.load_run(r["path"]))["t_step"]
            predicted = predict_cell(b, profile, "p2", r["cap"], variant)["t_step"]
            rows.append(
                {
                    "round": rnd,
                    "cap_mib": r["cap"],
                    "measured": measured,
                    "predicted": predicted,
                    "error": predicted / measured - 1,
                }
            )
    return rows


def print_check(rows: list[dict], variant: str) -> None:
    print(f"\nthe what-if check ({variant}): each round's 25 MiB run predicts that round's other caps, single runs")
    for r in rows:
        print(
            f"  round {r['round']}  {r['cap_mib']:>5g} MiB  measured {r['measured'] * 1e3:7.0f} ms  "
            f"predicted {r['predicted'] * 1e3:7.0f} ms  error {r['error']:+.1%}"
        )
    for rnd in sorted({r["round"] for r in rows}) + ["all"]:
        errs = [abs(r["error"]) for r in rows if rnd == "all" or r["round"] == rnd]
        if errs:
            print(f"  round {rnd}: median |error| {np.median(errs):.1%}, worst {max(errs):.1%} ({len(errs)} runs)")


def ms(s: dict) -> str:
    return f"{s['median'] * 1e3:.0f} [{s['lo'] * 1e3:.0f}..{s['hi'] * 1e3:.0f}]"


def print_table(ev: dict, variant: str) -> None:
    print(f"\nwhat-if ({variant}) vs measured, ms: median [min..max] over repeats (predicted: over base runs)")
    print(
        f"{'cell':<12} {'measured T_step':>20} {'predicted T_step':>20} {'error':>7} {'noise':>6} {'out?':>4} "
        f"{'own-compute pred':>20} {'error':>7} {'out?':>4} {'own exposed pred':>18} "
        f"{'T_comp meas':>18} {'T_comp err':>10} {'exposed meas':>18} {'exposed pred':>18} {'buckets':>8} "
        f"{'tail meas':>16} {'tail pred':>16} {'others':>10}"
    )
    for c in ev["cells"]:
        m, p = c["measured"], c["predicted"]
        oc = c["other_cores"]
        print(
            f"{c['layout'] + ' ' + format(c['cap_mib'], 'g') + ' MiB':<12} {ms(m['t_step']):>20} {ms(p['t_step']):>20} "
            f"{c['error']:+7.1%} {c['measured_halfspread']:6.1%} {'yes' if c['outside_noise'] else 'no':>4} "
            f"{ms(c['own']['t_step']):>20} {c['own_error']:+7.1%} {'yes' if c['own_outside_noise'] else 'no':>4} "
            f"{ms(c['own']['exposed']):>18} "
            f"{ms(m['t_comp']):>18} {c['comp_error']:+10.1%} {ms(m['exposed']):>18} {ms(p['exposed']):>18} "
            f"{m['n_buckets']['median']:>3.0f}/{p['n_buckets']['median']:<4.0f} "
            f"{ms(m['tail']):>16} {ms(p['tail']):>16} "
            f"{oc['lo']:.2f}..{oc['hi']:.2f}"
        )
    worst = max(ev["cells"], key=lambda c: abs(c["error"]))
    print(f"worst |error|: {worst['layout']} {worst['cap_mib']:g} MiB, {worst['error']:+.1%}")
    if ev.get("skipped_link"):
        print(f"emulated link skipped: {ev['skipped_link']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model: a smoke test of the script")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="the what-if check's cells only: 2 ranks at every cap")
    ap.add_argument("--steps", type=int, default=None, help="steps per run, the first a warm-up (4; --check 8)")
    ap.add_argument("--baseline", type=int, default=2, help="no-op hook steps per grid run (measured T_comp)")
    ap.add_argument("--base-baseline", type=int, default=None, help="no-op hook steps of the base run (4; --check 8)")
    ap.add_argument("--base-cap", type=float, default=None, help="the base run's cap, MiB (25; quick 0.05)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--rate", default="1gbit", help="the emulated link's tc rate")
    ap.add_argument("--out", default=None, help="where runs and profiles go (default: a new temp folder)")
    ap.add_argument(
        "--from",
        dest="src",
        default=None,
        help="re-evaluate the runs recorded under this folder (several, comma-separated: their repeats pooled)",
    )
    ap.add_argument(
        "--variant",
        default="before,cpu+alone+load+ready+stretch+wait,run.whatif",
        help=f"model variants to evaluate, comma-separated, of: {', '.join(VARIANTS)}",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    # the check compares single runs: 7 measured steps each (not 3) so that one run's median is not its noise
    # (3 steps of one run spread by 8% on the 2-core machine; see docs/benchmarks.md, the what-if check)
    a.steps = a.steps or (8 if a.check else 4)
    a.base_baseline = a.base_baseline or (8 if a.check else 4)
    a.model = "tiny" if a.quick else "distilbert"
    if a.quick:
        a.batch_size, a.seq_len = 4, 32
    a.base_cap = a.base_cap or (0.05 if a.quick else 25.0)
    root = a.src
    if root is None:
        root = a.out or os.path.join("/tmp", f"dtlab-whatif-error-{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(root, exist_ok=True)
        t0 = time.time()
        measure(a, root)
        print(f"measured in {time.time() - t0:.0f} s: {root}")
    out = {}
    for variant in a.variant.split(","):
        out[variant] = evaluate(root.split(","), variant)
        print_table(out[variant], variant)
        if a.check:
            out[variant]["check"] = [row for r in root.split(",") for row in check_rounds(r, variant)]
            print_check(out[variant]["check"], variant)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"root": root, "variants": out}, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
