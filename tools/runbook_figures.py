"""The figures tools/gpu_runbook.py writes into summary.json, read from run directories with dtlab's own loaders.

Each function returns (figures, ok): JSON-safe numbers with their units in the key names, and whether the run
says what it must (every gradient byte all-reduced once per rank and step; ZeRO-3 finished; a fit per op).
"""

from __future__ import annotations

import json
import os


def _records(df) -> list:
    return json.loads(df.to_json(orient="records"))


def ddp_figures(run_dir: str, nccl: bool = False) -> tuple[dict, bool]:
    """T_step, T_comp, T_comm, exposed, overlap (ms), bytes and buckets per step, the cross-checks, and how the
    times were taken (the placement's timing and the recorder's end stream). ok: every gradient byte all-reduced
    once per rank and step; with `nccl` (a GPU run given an NCCL library) also NCCL ranks timed by CUDA events and
    dtlab's bucket times compared with NCCL's own durations (`run.crosscheck()`, pairs > 0)."""
    from dtlab.results.run import load_run

    run = load_run(run_dir)
    summ = run.summary()
    s = summ.set_index("quantity")["value"]
    per = run.buckets.groupby(["rank", "step"])["nbytes"].sum()
    steady = run.buckets[run.buckets["step"] >= run.warmup].groupby(["rank", "step"]).size()
    figs = {
        "placement": run.resolved.get("placement", {}),
        "devices": run.resolved.get("devices"),
        "torch": run.resolved.get("versions", {}).get("torch"),
        "nccl": run.resolved.get("nccl"),
        "bucket_timing": run.resolved.get("bucket_timing"),
        "T_step_ms": s["T_step"] * 1e3,
        "T_comp_ms": s["T_comp"] * 1e3,
        "T_comm_ms": s["T_comm"] * 1e3,
        "exposed_ms": s["exposed"] * 1e3,
        "overlap": s["overlap"],
        "how": dict(zip(summ["quantity"], summ["how"])),
        "grad_bytes": run.resolved["grad_bytes"],
        "bytes_per_rank_step": sorted(set(per.tolist())),
        "buckets_per_step": sorted(set(steady.tolist())),
        "crosscheck": _records(run.crosscheck()),
    }
    ok = set(per.tolist()) == {run.resolved["grad_bytes"]}
    if nccl:
        vs = [r for r in figs["crosscheck"] if r.get("quantity") == "bucket all-reduce duration vs NCCL"]
        figs["nccl_pairs"] = int(vs[0]["pairs"]) if vs else 0
        on_nccl = figs["placement"].get("backend") == "nccl" and (figs["bucket_timing"] or {}).get("path") == "nccl"
        ok = ok and on_nccl and figs["nccl_pairs"] > 0
    return figs, ok


def zero3_figures(run_dir: str) -> tuple[dict, bool]:
    """Bytes per rank and step by phase and op, memory per rank, the summary, where the ranks ran."""
    from dtlab.results.run import load_run

    run = load_run(run_dir)
    c = run.collectives[run.collectives["step"] >= run.warmup]
    by = c.groupby(["phase", "op"])["nbytes"].sum() / max(1, c["step"].nunique() * run.nproc)
    figs = {
        "bytes_per_rank_step": {f"{p}/{o}": int(v) for (p, o), v in by.items()},
        "expected_reduce_scatter_bytes_per_step": run.resolved.get("expected_reduce_scatter_bytes_per_step"),
        "memory": _records(run.memory),
        "summary": _records(run.summary()),
        "placement": run.resolved.get("placement"),
        "deepspeed_local_rank": run.resolved.get("deepspeed_local_rank"),
        "collective_timing": run.resolved.get("collective_timing"),
        "unfinished_collectives": int(c["t_end"].isna().sum()),
    }
    return figs, run.status.get("state") == "finished"


def calibration_figures(profile_dir: str) -> tuple[dict, bool]:
    """alpha (us, with its interval), the bandwidth 1/beta implies (GB/s), form and fit error, per op."""
    from dtlab.results.calibration import load_profile

    prof = load_profile(profile_dir)
    figs = {
        op: {
            "alpha_us": f.alpha * 1e6,
            "alpha_ci_us": [a * 1e6 for a in f.alpha_ci],
            "busbw_GBps_from_beta": (1 / f.beta / 1e9) if f.beta > 0 else None,
            "form": f.form,
            "rel_rms": f.rel_rms,
        }
        for op, f in prof.fits.items()
    }
    figs["timing"] = prof.meta.get("timing")
    figs["placement"] = prof.meta.get("placement", {}).get("label")
    return figs, bool(prof.fits)


def model_error_figures(run_dir: str, profile_dir: str) -> tuple[dict, bool]:
    """The alpha-beta model's errors on one DDP run priced with one calibration (dtlab.predict, idle prices): the
    median absolute T_step and T_comm errors over the steps, and the predicted and measured medians (ms)."""
    from dtlab.model.prediction import predict, prediction_summary
    from dtlab.results.calibration import load_profile
    from dtlab.results.run import load_run

    pred = predict(load_run(run_dir), load_profile(profile_dir))
    figs = prediction_summary(pred)
    for col in ("measured_t_step", "predicted_t_step", "measured_t_comm", "predicted_t_comm"):
        if col in pred.columns:
            figs[f"{col}_median_ms"] = float(pred[col].median()) * 1e3
    return figs, figs["steps"] > 0


def lab_plan(notebook: str) -> list:
    """Where the launches of lab NOTEBOOK ("04_zero3_vs_ddp.ipynb") place their ranks on this machine
    (dtlab.course.labs, quick mode as the runbook runs it)."""
    from dtlab.config.placement import machine_gpus
    from dtlab.course.labs import lab_parts

    ngpu, nccl = machine_gpus()
    return lab_parts(notebook[:2], ngpu, nccl, quick=True)


LAB_SECONDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu-lab-seconds.json")


def recorded_lab_seconds() -> dict:
    """{notebook: {"seconds", "record"}}: each lab's slowest clean time on a GPU, over the H200 record shipped with
    dtlab (dtlab/results/recorded-runs/*/labs.json) and the records in tools/gpu-lab-seconds.json. A lab that
    showed an error, crashed or was cut by the budget has no time in that record (its seconds say when it stopped,
    not how long it takes); a lab no record times cleanly is absent."""
    import glob

    import dtlab.results as results

    records = {}
    for path in sorted(glob.glob(os.path.join(os.path.dirname(results.__file__), "recorded-runs", "*", "labs.json"))):
        with open(path) as f:
            labs = json.load(f)
        clean = {n: r.get("seconds") for n, r in labs.items() if not r.get("errors") and not r.get("exec_error")}
        records[os.path.basename(os.path.dirname(path))] = clean
    if os.path.exists(LAB_SECONDS):
        with open(LAB_SECONDS) as f:
            for name, rec in json.load(f)["records"].items():
                records[name] = rec["seconds"]
    out = {}
    for record, seconds in records.items():
        for lab, s in seconds.items():
            if s and (lab not in out or s > out[lab]["seconds"]):
                out[lab] = {"seconds": s, "record": record}
    return out


def recorded_step_seconds() -> dict:
    """{step: {"seconds", "record"}}: each runbook step's slowest time on a GPU (tools/gpu-lab-seconds.json's
    "steps"), for steps that ran there as they are now; a step no record times is absent (planned at its cap)."""
    if not os.path.exists(LAB_SECONDS):
        return {}
    with open(LAB_SECONDS) as f:
        records = json.load(f).get("steps", {})
    out = {}
    for record, rec in records.items():
        for step, s in rec["seconds"].items():
            if s and (step not in out or s > out[step]["seconds"]):
                out[step] = {"seconds": s, "record": record}
    return out


def lab_record(executed: str) -> dict:
    """What an executed lab notebook shows: the error outputs (ename: evalue) and every claim it printed with its
    outcome and, where the claim's own numbers disagree with its outcome, the problems
    (dtlab.course.claims.consistent)."""
    import os

    from dtlab.course.claims import consistent, parse_claims

    if not os.path.exists(executed):
        return {"errors": ["the executed notebook was not written"], "claims": []}
    with open(executed) as f:
        nb = json.load(f)
    errors = [
        f"{o.get('ename')}: {o.get('evalue')}"
        for c in nb.get("cells", [])
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    claims = []
    for c in parse_claims(executed):
        try:
            problems = consistent(c)
        except Exception as e:  # noqa: BLE001 - a malformed record is itself a finding
            problems = [f"unreadable claim record: {type(e).__name__}: {e}"]
        claims.append(
            {
                "cid": c.get("cid"),
                "outcome": c.get("outcome"),
                "says": c.get("says"),
                "why": c.get("why"),
                "problems": problems,
            }
        )
    return {"errors": errors, "claims": claims}


def lab_runs(where: str) -> list:
    """Each run a lab wrote under WHERE/runs: strategy, ranks, placement, state and its summary (ms)."""
    import glob
    import os

    from dtlab.results.run import load_run

    out = []
    for d in sorted(glob.glob(os.path.join(where, "runs", "*", "config.json"))):
        try:
            run = load_run(os.path.dirname(d))
        except Exception as e:  # noqa: BLE001 - a broken run is reported, not fatal
            out.append({"dir": os.path.dirname(d), "error": f"{type(e).__name__}: {e}"})
            continue
        s = run.summary()
        out.append(
            {
                "dir": os.path.basename(run.path),
                "strategy": run.config.strategy,
                "nproc": run.nproc,
                "placement": run.resolved.get("placement", {}).get("label"),
                "state": run.status.get("state"),
                "ms": {q: (v * 1e3 if u == "s" else v) for q, v, u in zip(s["quantity"], s["value"], s["unit"])},
            }
        )
    return out
