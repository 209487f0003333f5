"""A calibration directory -> its samples and the machine Profile fitted from them (dtlab.model.profile)."""

from __future__ import annotations

import glob
import json
import os
import warnings

import pandas as pd

from dtlab.model.fit import PROFILE_FILE, REQUIRED_COLUMNS, AlphaBetaFit
from dtlab.model.profile import Profile
from dtlab.model.sharing import fit_alone, fit_stretch
from dtlab.results.events import read_events
from dtlab.results.status import RunFailed, read_run_dir, require_finished, sweep_progress
from dtlab.results.upgrade import upgrade_event
from dtlab.runfiles import RunDamageWarning


def samples_frame(run_dir: str):
    """The raw samples of a calibration directory: one row per rank and timed iteration, plus the slowest
    rank per iteration as `seconds` (columns op, nbytes, nproc, load, iter, seconds, rank_spread). `load` is
    'idle', or 'backward' for samples issued from inside a replayed backward pass (CalibConfig.load), whose
    `seconds` are the rank's that issued last (see below)."""

    rows = [
        upgrade_event(e, 1)  # a calibration's config carries no version (dtlab.results.upgrade)
        for p in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.jsonl")))
        for e in read_events(p)
        if e.get("kind") == "sample"
    ]
    raw = pd.DataFrame(rows, columns=["rank", "op", "nbytes", "nproc", "load", "iter", "seconds"])
    if raw.empty:
        return raw, raw
    g = raw.groupby(["op", "nbytes", "nproc", "load", "iter"])["seconds"]
    slow = g.max().rename("seconds").to_frame()
    slow["rank_spread"] = g.max() - g.min()
    # A loaded sample is issued from inside each rank's backward pass, where the ranks are not aligned: the rank
    # that issued first also waited for its peer. The rank that issued last timed the collective itself (its
    # service time under load); the wait is what the replay takes from the ranks' own recorded issue times.
    loaded = slow.index.get_level_values("load") != "idle"
    slow.loc[loaded, "seconds"] = g.min()[loaded]
    return raw, slow.reset_index()


def load_calibration(run_dir: str, partial: bool = False):
    """Fit (or re-fit) the samples of a calibration directory, write profile.json, return the Profile.

    Raises RunFailed (its `state` says how the sweep ended: interrupted, stopped, failed, abandoned, ...; its
    `run`: the samples recorded) when the sweep did not finish, unless `partial`: then what was recorded is
    fitted, and the profile says in its caveats and meta['partial'] that the sweep did not finish."""

    rec = read_run_dir(run_dir, key="calibration")
    for w in rec.warnings:
        warnings.warn(f"{run_dir}: {w}", RunDamageWarning, stacklevel=2)
    doc, cal = rec.doc, rec.doc["calibration"]
    raw, samples = samples_frame(run_dir)
    recorded = sweep_progress(rec)
    try:
        require_finished(
            rec,
            "the calibration",
            run=samples,
            hint=f"{recorded}; no profile was written. dtlab.results.calibration.load_calibration(path, "
            "partial=True) fits what was recorded, labelled as partial.",
        )
        unfinished = None
    except RunFailed as e:
        if not partial or raw.empty:
            raise
        unfinished = f"partial: the sweep {e.state} before it finished ({recorded}); fitted from those samples only"
    meta = {
        **doc.get("resolved", {}),
        "calibration": cal,
        "rank_samples": len(raw),
        "timing": doc.get("resolved", {}).get(
            "timing", "slowest rank per iteration; barrier before each iteration (not timed)"
        ),
    }
    caveats = _node_facts(run_dir, meta) + ([unfinished] if unfinished else []) + _load_facts(run_dir, meta)
    meta["partial"] = unfinished is not None
    if meta.get("backend") == "gloo" and meta.get("nnodes", 1) == 1:
        caveats.append(
            "gloo over loopback TCP on shared CPU cores: alpha and beta describe this host's memory "
            "and loopback, not a network; collectives compete with compute for the cores."
        )
        if "reduce_scatter" in cal["ops"]:
            caveats.append(
                "gloo's reduce_scatter_tensor is an all-reduce followed by taking a chunk: it moves "
                "about twice the data of a real reduce-scatter, so it will not follow the "
                "reduce-scatter formula; compare its fit with the all-reduce fit."
            )
        if "ps" in cal["ops"]:
            caveats.append(
                "ps on gloo is its reduce (a ring reduce-scatter + a gather into rank 0) then its "
                "broadcast (a binomial tree), not one server link: see dtlab.model.ps."
            )
    if meta.get("oversubscribed"):
        caveats.append(f"{meta.get('world_size')} ranks on {meta.get('cpu_cores')} cores: oversubscribed.")
        over = (
            [int(k) for k in sorted(samples["nproc"].unique()) if k > (meta.get("cpu_cores") or k)]
            if not samples.empty
            else []
        )
        if over:
            caveats.append(
                f"timed on more ranks than the {meta.get('cpu_cores')} cores (p = "
                f"{', '.join(map(str, over))}): those samples share the cores, oversubscribed."
            )

    profile = Profile.from_samples(
        samples,
        meta=meta,
        form=cal.get("form", "ring"),
        caveats=caveats,
        min_bytes=cal.get("fit_min_bytes"),
        max_bytes=cal.get("fit_max_bytes"),
    )
    profile.save(run_dir)
    return profile


def _load_facts(run_dir: str, meta: dict) -> list[str]:
    """meta['load']: how the loaded samples were made (the model, batch and threads of the replayed backward pass,
    how many passes each rank replayed); the caveat a loaded profile needs. [] for an idle sweep."""

    events = [
        e
        for p in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.jsonl")))
        for e in read_events(p)
        if e.get("kind") in ("load", "load_done", "load_pass")
    ]
    made = next((e for e in events if e["kind"] == "load"), None)
    if made is None:
        return []
    done = {e["rank"]: e for e in events if e["kind"] == "load_done"}
    meta["load"] = {
        "what": "backward",
        "model": made.get("model"),
        "batch_size": made.get("batch_size"),
        "seq_len": made.get("seq_len"),
        "threads_per_rank": made.get("threads"),
        "passes": {str(r): e.get("passes") for r, e in sorted(done.items())},
        "how": "each collective issued from a gradient hook inside a replayed backward pass "
        "(loss.backward(retain_graph=True)) once the previous one completed, its end marked in "
        "its future's callback, as DDP issues and dtlab records a bucket",
    }
    passes = [e for e in events if e["kind"] == "load_pass"]
    stretch, alone = fit_stretch([p for p in passes if not p.get("solo")]), fit_alone(passes)
    notes = []
    if alone is not None:
        meta["load"]["alone"] = alone
        notes.append(
            f"a rank's backward pass alone took {alone['alone_s'] * 1e3:.0f} ms, {alone['ratio']:.2f}x its "
            f"{alone['together_s'] * 1e3:.0f} ms beside {alone['ranks'] - 1} other rank(s) computing (medians; "
            "dtlab.model.sharing.fit_alone)"
        )
    if stretch is not None:
        meta["load"]["stretch"] = stretch
        notes.append(
            f"backward compute lost {stretch['per_second']:.2f} s per s of communication in flight beside it "
            f"[{stretch['lo']:.2f}..{stretch['hi']:.2f}] ({stretch['passes']} loaded passes against "
            f"{stretch['idle_passes']} with nothing in flight; dtlab.model.sharing)"
        )
    return notes + [
        f"loaded fits ('backward'): each collective issued from inside a replayed backward pass of "
        f"{made.get('model')} (batch {made.get('batch_size')} x {made.get('seq_len')} tokens, "
        f"{made.get('threads')} thread(s) per rank), as a DDP bucket is: what it costs while backward compute "
        "shares the machine, the wait for a peer that issues later included"
    ]


def _node_facts(run_dir: str, meta: dict) -> list[str]:
    """Add where every rank ran (meta['ranks']: rank, node, local_rank, host; meta['hosts']) and the link a
    dtlab.launching.emulate sweep crossed (meta['emulation']); return the caveats a multi-node profile needs."""

    starts = [next(iter(read_events(p)), {}) for p in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.jsonl")))]
    meta["ranks"] = sorted(
        ({k: e.get(k) for k in ("rank", "node", "local_rank", "host")} for e in starts if e.get("kind") == "start"),
        key=lambda e: e["rank"],
    )
    meta["hosts"] = sorted({e["host"] for e in meta["ranks"]})
    if os.path.exists(os.path.join(run_dir, "emulation.json")):
        with open(os.path.join(run_dir, "emulation.json")) as f:
            meta["emulation"] = json.load(f)
    nodes = len({e["node"] for e in meta["ranks"]})
    if nodes < 2:
        return []
    link = meta.get("emulation", {}).get("link", "")
    where = (
        f"emulated on one host ({link or 'loopback TCP: no network at all'})"
        if len(meta["hosts"]) == 1
        else f"hosts {', '.join(meta['hosts'])}"
    )
    per = meta.get("ranks_per_node", 1)
    return [
        f"{len(meta['ranks'])} ranks on {nodes} nodes, {per} per node, {where}: "
        + (
            "every collective crosses the inter-node link."
            if per == 1
            else "a flat ring mixes intra- and inter-node hops; the slower link sets beta."
        )
    ]


def load_profile(path) -> Profile:
    """Load a Profile from a directory containing profile.json, or from the file itself. For a calibration
    directory without profile.json (a sweep that did not finish) RunFailed says how it ended (`state`:
    interrupted, stopped, failed, abandoned, ...)."""
    file = os.path.join(path, PROFILE_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file) and os.path.isfile(os.path.join(path, "config.json")):
        rec = read_run_dir(path, key="calibration")
        require_finished(
            rec,
            "the calibration",
            hint=f"{sweep_progress(rec)}; no profile was written. "
            "dtlab.results.calibration.load_calibration(path, partial=True) fits what was recorded, labelled "
            "as partial.",
        )
        raise ValueError(
            f"path: {path!r} holds a finished calibration without {PROFILE_FILE}: "
            "dtlab.results.calibration.load_calibration(path) fits its samples and writes it"
        )
    if not os.path.isfile(file):
        raise ValueError(f"path must be a profile directory or a {PROFILE_FILE} file, got {path!r}")
    with open(file, encoding="utf-8") as fh:
        doc = json.load(fh)
    samples = pd.DataFrame.from_records(doc.get("samples", []))
    if samples.empty and len(samples.columns) == 0:
        samples = pd.DataFrame(columns=list(REQUIRED_COLUMNS))
    return Profile(
        meta=doc.get("meta", {}),
        samples=samples,
        fits={op: AlphaBetaFit.from_dict(d) for op, d in doc.get("fits", {}).items()},
        caveats=list(doc.get("caveats", [])),
        segments={op: [AlphaBetaFit.from_dict(d) for d in segs] for op, segs in doc.get("segments", {}).items()},
        loaded_fits={op: AlphaBetaFit.from_dict(d) for op, d in doc.get("loaded_fits", {}).items()},
        loaded_segments={
            op: [AlphaBetaFit.from_dict(d) for d in segs] for op, segs in doc.get("loaded_segments", {}).items()
        },
    )
