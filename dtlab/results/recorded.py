"""Runs recorded on real hardware and shipped with dtlab: what a student on a CPU can set beside their own run.

Each set is a folder of package data, `dtlab/results/recorded-runs/SET/` (today one: `h200-torch2.11`, one NVIDIA
H200), with `provenance.json` (machine, versions, date, dtlab commit, placement, what was random-init), the run
directories as `.tar.gz`, a calibration's fitted figures and the per-lab record; its README.md says the same in
words. Not to be confused with `reference=True` (a run's single-process copy, dtlab.results.reference).

- `recorded_runs()`: one row per shipped run and calibration (name, kind, what, machine, placement, date).
- `recorded_run(name)`: a `RecordedRun`: the `Run` (the directory extracted once into dtlab's cache and read by
  `load_run`, like any run) and its provenance.
- `recorded_calibration(name)`: a `RecordedCalibration`: a `Profile` holding the recorded fits (no samples: only
  the fitted figures came back from the machine; its caveats say so) and its provenance.
- `run_figures(run)`: the figures a recorded run is compared by (ms, bytes and calls a rank-step).

Pure: no torch; it writes only into the cache (`$DTLAB_CACHE`, else `$XDG_CACHE_HOME/dtlab` or `~/.cache/dtlab`, else
a folder in the temporary directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtlab.model import costmodel
from dtlab.model.fit import AlphaBetaFit
from dtlab.model.profile import Profile
from dtlab.results.run import Run, load_run

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded-runs")
CACHE_ENV = "DTLAB_CACHE"


@dataclass
class RecordedRun:
    """A shipped run: `run` (a `Run`, loaded from its extracted directory `run.path`) and `provenance` (the set's
    machine, versions, date, commit, placement, random-init note, and this run's command and description)."""

    name: str
    run: Run
    provenance: dict

    def label(self) -> str:
        """One line: where and when it was recorded, on what."""
        return provenance_line(self.provenance)


@dataclass
class RecordedCalibration:
    """A shipped calibration: `profile` (a `Profile` with the recorded fits and no samples), `figures` (op, form,
    alpha_us, alpha_ci_us, busbw_GBps, rel_rms, as recorded) and `provenance`."""

    name: str
    profile: Profile
    figures: pd.DataFrame
    provenance: dict

    def label(self) -> str:
        return provenance_line(self.provenance)


def provenance_line(prov: dict) -> str:
    """'one NVIDIA H200, gloo on CUDA tensors, 2 ranks on 1 GPU; torch 2.11.0+cu130, Python 3.12.3; recorded
    2026-11-26 (dtlab 2e4fb63)': where, on what and when."""
    v = prov.get("versions", {})
    return (
        f"{prov['machine']['name']}, {prov['placement']}; torch {v.get('torch')}, Python {v.get('python')}; "
        f"recorded {prov['recorded']} (dtlab {prov['dtlab_commit'][:7]})"
    )


def _sets() -> dict[str, dict]:
    out = {}
    for name in sorted(os.listdir(DATA)) if os.path.isdir(DATA) else []:
        path = os.path.join(DATA, name, "provenance.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                out[name] = json.load(f)
    return out


def _entry(name: str, kind: str) -> tuple[str, dict, dict]:
    """(set folder, the set's provenance, the entry) of a shipped run ('runs') or calibration ('calibrations')."""
    known = []
    for set_name, prov in _sets().items():
        entries = prov.get(kind, {})
        known += list(entries)
        if name in entries:
            return os.path.join(DATA, set_name), prov, entries[name]
    what = "run" if kind == "runs" else "calibration"
    raise ValueError(
        f"no recorded {what} named {name!r}; recorded {what}s: {', '.join(known) or 'none'} "
        "(dtlab.recorded_runs() lists them)"
    )


def _provenance(prov: dict, name: str, entry: dict) -> dict:
    common = {k: v for k, v in prov.items() if k not in ("runs", "calibrations", "labs", "format")}
    return {**common, "name": name, **entry}


def recorded_runs() -> pd.DataFrame:
    """Every shipped run and calibration: name, kind ('run' or 'calibration'), what, machine, placement, recorded
    (date), torch, command."""
    rows = []
    for prov in _sets().values():
        for kind, key in (("run", "runs"), ("calibration", "calibrations")):
            for name, e in prov.get(key, {}).items():
                rows.append(
                    {
                        "name": name,
                        "kind": kind,
                        "what": e["what"],
                        "machine": prov["machine"]["name"],
                        "placement": prov["placement"],
                        "recorded": prov["recorded"],
                        "torch": prov["versions"]["torch"],
                        "command": e["command"],
                    }
                )
    return pd.DataFrame(rows, columns=["name", "kind", "what", "machine", "placement", "recorded", "torch", "command"])


def cache_root() -> str:
    """Where shipped run directories are extracted: $DTLAB_CACHE, else $XDG_CACHE_HOME/dtlab or ~/.cache/dtlab;
    a folder in the temporary directory when that cannot be written."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dtlab"
    )
    try:
        os.makedirs(root, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    root = os.path.join(tempfile.gettempdir(), f"dtlab-cache-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    os.makedirs(root, exist_ok=True)
    return root


def _safe_members(tar: tarfile.TarFile, top: str) -> list:
    """The archive's members, refused unless each is a plain file or folder under `top`."""
    members = tar.getmembers()
    for m in members:
        parts = m.name.split("/")
        if not (m.isfile() or m.isdir()) or os.path.isabs(m.name) or ".." in parts or parts[0] != top:
            raise ValueError(f"{tar.name}: unexpected member {m.name!r} (a recorded run holds only {top}/...)")
    return members


def extract(archive: str, top: str) -> str:
    """The run directory `top` of `archive`, extracted once into the cache (a folder named after the archive's
    digest, so a changed archive is extracted anew); an extraction another process finished first is used."""
    with open(archive, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    parent = os.path.join(cache_root(), "recorded", os.path.basename(os.path.dirname(archive)))
    final = os.path.join(parent, f"{top}-{digest}")
    if _complete(final):
        return final
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{top}-", dir=parent)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = _safe_members(tar, top)
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=members, **kw)
        if os.path.isdir(final) and not _complete(final):  # damaged by hand (a file deleted): replaced whole
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(os.path.join(tmp, top), final)  # whole or not at all
        except OSError:
            if not _complete(final):  # not another process's finished extraction
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _complete(run_dir: str) -> bool:
    """An extracted run directory with its config and every rank's events (as the ranks that wrote it left them)."""
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            world = int(json.load(f).get("resolved", {}).get("world_size") or 1)
    except (OSError, ValueError):
        return False
    return all(os.path.isfile(os.path.join(run_dir, "events", f"rank{r}.jsonl")) for r in range(world))


def recorded_run(name: str) -> RecordedRun:
    """A shipped run by name ('h200-ddp', 'h200-zero3'; `recorded_runs()` lists them), loaded with `load_run`."""
    folder, prov, entry = _entry(name, "runs")
    path = extract(os.path.join(folder, entry["archive"]), entry["dir"])
    return RecordedRun(name, load_run(path), _provenance(prov, name, entry))


def recorded_calibration(name: str = "h200-calibration") -> RecordedCalibration:
    """A shipped calibration by name: its recorded fits as a `Profile` (alpha and 1/beta as recorded; no samples,
    no residuals, beta's interval unknown: NaN)."""
    folder, prov, entry = _entry(name, "calibrations")
    with open(os.path.join(folder, entry["file"]), encoding="utf-8") as f:
        cal = json.load(f)["calibration"]
    fits, rows = {}, []
    p = int(entry["nproc"])
    for op, fig in sorted(cal.items()):
        if not isinstance(fig, dict):
            continue  # "timing", "placement": words
        beta = 1 / (fig["busbw_GBps_from_beta"] * 1e9)  # the record's figure is 1/beta (tools/runbook_figures.py)
        fits[op] = AlphaBetaFit(
            op=op,
            form=fig["form"],
            alpha=fig["alpha_us"] * 1e-6,
            beta=beta,
            alpha_ci=tuple(a * 1e-6 for a in fig["alpha_ci_us"]),
            beta_ci=(np.nan, np.nan),
            min_bytes=entry["min_bytes"],
            max_bytes=entry["max_bytes"],
            n_points=entry["n_points"],
            n_samples=0,
            rel_rms=fig["rel_rms"],
            warnings=["recorded fit: the samples behind it were not kept"],
        )
        rows.append(
            {
                "op": op,
                "form": fig["form"],
                "alpha_us": fig["alpha_us"],
                "alpha_ci_us": fig["alpha_ci_us"],
                "busbw_GBps": fig["busbw_GBps_from_beta"],
                "rel_rms": fig["rel_rms"],
            }
        )
    meta = {
        "recorded": name,
        "placement": {"label": cal.get("placement"), "backend": "gloo", "device": "cuda"},
        "device_type": "cuda",
        "timing": cal.get("timing"),
        "world_size": p,
        "backend": "gloo",
        "versions": prov["versions"],
        "machine": prov["machine"],
    }
    profile = Profile(
        meta=meta,
        fits=fits,
        caveats=[f"recorded on {provenance_line(prov)}: {entry['only_fits']}", prov["placement_why"]],
    )
    return RecordedCalibration(name, profile, pd.DataFrame(rows), _provenance(prov, name, entry))


def lab_record(set_name: str = "h200-torch2.11") -> dict:
    """The per-lab record of a set (labs.json): {notebook: {seconds, exec_error, errors, claims, placement}}."""
    if set_name not in _sets():
        raise ValueError(f"no recorded set named {set_name!r}; sets: {', '.join(_sets()) or 'none'}")
    with open(os.path.join(DATA, set_name, _sets()[set_name]["labs"]["file"]), encoding="utf-8") as f:
        return json.load(f)


# ---- the figures a recorded run is compared by ------------------------------------------------------------


def bus_factor(op: str, nproc: int) -> float:
    """nccl-tests' bus factor: busbw = algbw x this (2(p-1)/p for all-reduce, (p-1)/p for the others)."""
    return float(costmodel.busbw(op, 1.0, 1.0, nproc))


def bus_bandwidth(fit: AlphaBetaFit, nproc: int) -> float:
    """The bus bandwidth (bytes/s) a fit's bandwidth term gives, whatever its form: busbw of a message so large that
    alpha is negligible, i.e. n / (beta B(p) n) x the bus factor (1/beta for the ring form); inf for beta <= 0."""
    b = float(costmodel.coefficients(fit.op, fit.form, nproc)[1]) * fit.beta
    return bus_factor(fit.op, nproc) / b if b > 0 else float("inf")


def run_figures(run: Run) -> dict:
    """T_step, T_comp, T_comm, exposed (ms) and overlap from `run.summary()`; bytes_per_rank_step and
    calls_per_rank_step: the median over measured rank-steps of the bytes and the collective calls (DDP buckets or
    ZeRO-3 collectives) a rank issued in a step. NaN where not measured."""
    s = run.summary().set_index("quantity")
    val = lambda q: float(s.loc[q, "value"]) if q in s.index else np.nan  # noqa: E731
    frames = [df for df in (run.buckets, run.collectives) if not df.empty]
    comm = (
        pd.concat([df[["rank", "step", "nbytes"]] for df in frames])
        if frames
        else pd.DataFrame(columns=["rank", "step", "nbytes"])
    )
    comm = comm[comm["step"] >= run.warmup]
    per = comm.groupby(["rank", "step"])["nbytes"].agg(["sum", "size"])
    return {
        "T_step_ms": val("T_step") * 1e3,
        "T_comp_ms": val("T_comp") * 1e3,
        "T_comm_ms": val("T_comm") * 1e3,
        "exposed_ms": val("exposed") * 1e3,
        "overlap": val("overlap"),
        "bytes_per_rank_step": float(per["sum"].median()) if len(per) else np.nan,
        "calls_per_rank_step": float(per["size"].median()) if len(per) else np.nan,
    }
