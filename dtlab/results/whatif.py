"""The what-if for the run you have: `run.whatif(profile_or_link, bucket_mb=..., nproc=..., nodes=...,
compression=...)`, the same as `dtlab.whatif(run, ...)`. One DDP step predicted at another bucket cap, rank count,
node count or compression ratio, from everything the run measured, with its band and a list of the inputs it used
and of those it could not use (and why).

What a run gives the step model (dtlab.model.whatif.whatif):

- compute: its no-op hook baseline steps (forward, backward, optimizer per rank; medians, slowest rank), or,
  without them, backward estimated as the time until the last bucket was ready (said so);
- bucket readiness: the fraction of backward at which each byte of gradients was ready (its measured buckets);
- cores: where its ranks shared a machine's CPU cores, compute scaled by the fair share at the new rank count,
  with the other processes' load while it ran (dtlab.results.busy) and, from a loaded calibration, a rank's
  compute alone against beside the others (dtlab.model.sharing);
- measured wait: its exposed communication in paired steps beyond the queue's (ranks waiting for each other);
- the link: a Profile (any source: dtlab.calibrate, a recorded or published one), a Link or a TwoLevelLink
  (dtlab.model.link): alpha, beta, form, and where measured, contention and stretch.

The run's cores, load and wait describe the machine it ran on, so they are used only where the link was measured
there too (a Profile calibrated on the run's host with its backend; `here=True` says so of a Link). Elsewhere the
prediction is of the run's per-rank compute on a device of its own per rank, priced on that link: the inputs list
says which. A public nccl-tests output (dtlab.public_nccl_tests) is such a link by nature: another system's
collectives, each timed alone, so it never has contention, stretch or this machine's wait, and the lines say what it
is rather than list those as missing. A link from a piecewise fit prices each bucket by its size's regime.

Band: the link's interval of alpha and beta (and stretch, where fitted) pushed through the same step, or none,
saying why. Units: seconds, bytes, MiB for bucket caps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from dtlab.model import whatif as wi
from dtlab.model.compression import compression_from_run
from dtlab.model.link import Link, TwoLevelLink, as_link
from dtlab.results.busy import machine_load

QUANTITIES = (("t_step", "T_step"), ("t_comp", "T_comp"), ("t_comm", "T_comm"), ("exposed", "exposed"))


@dataclass
class WhatIf:
    """`run.whatif(...)`'s answer: the predicted DDP step and what it stands on.

        t_step, t_comp, t_comm, exposed: seconds (the definitions every lab uses: exposed = T_step - T_comp);
        lo, hi: {quantity: seconds} at the band's fast and slow ends (empty without a band); band: how the band was
        made, or why there is none; setting: bucket_mb (MiB), nproc (ranks per node), nodes, ranks, ratio, here (whether
    the link was taken as measured on the run's machine);
        used: one line per input taken from the run or the link, with where it comes from; not_used: one line per
        input it could not use, with why; link: the Link or TwoLevelLink priced; detail: dtlab.model.whatif.whatif's
        dict (bucket layout, ready times, durations, stretch_s...)."""

    t_step: float
    t_comp: float
    t_comm: float
    exposed: float
    lo: dict
    hi: dict
    band: str
    setting: dict
    used: list = field(default_factory=list)
    not_used: list = field(default_factory=list)
    link: Link | TwoLevelLink | None = None
    detail: dict = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """quantity (T_step, T_comp, T_comm, exposed), value, lo, hi (seconds; NaN without a band) and unit."""
        rows = [
            (name, getattr(self, k), self.lo.get(k, math.nan), self.hi.get(k, math.nan), "s") for k, name in QUANTITIES
        ]
        return pd.DataFrame(rows, columns=["quantity", "value", "lo", "hi", "unit"])

    def lines(self) -> list[str]:
        """The prediction in words: setting, each quantity in ms with its band, inputs used and not used."""
        s = self.setting
        out = [
            f"what-if: {s['ranks']} rank(s) ({s['nodes']} node(s) x {s['nproc']}), bucket {s['bucket_mb']:g} MiB, "
            f"bytes on the wire x {s['ratio']:.3g}, link {self.link.form}"
        ]
        for k, name in QUANTITIES:
            band = f" [{self.lo[k] * 1e3:.4g}..{self.hi[k] * 1e3:.4g}]" if k in self.lo else ""
            out.append(f"  {name:<8} {getattr(self, k) * 1e3:10.4g} ms{band} (predicted)")
        out.append(f"  band: {self.band}")
        out += [f"  used: {u}" for u in self.used] + [f"  not used: {u}" for u in self.not_used]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _positive_int(name: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1 ({what}), got {value!r}")
    return int(value)


def _ratio(run, compression, used: list, not_used: list) -> tuple[float, float]:
    """(bytes on the wire / gradient bytes, encode s/B): `compression` None keeps the run's own (measured where it
    compressed); a number in (0, 1] is that ratio, with the run's measured encode time where it had a hook."""
    hook = run.config.compression.hook
    measured = compression_from_run(run) if hook not in (None, "none") else None
    if compression is None:
        if measured is None:
            return 1.0, 0.0
        used.append(
            f"compression: ratio {measured['ratio']:.3g}, encode {measured['encode_s']:.3g} s ({measured['source']})"
        )
        return float(measured["ratio"]), float(measured["encode_s_per_byte"])
    ok = isinstance(compression, (int, float)) and not isinstance(compression, bool)
    if not ok or not math.isfinite(float(compression)) or not 0 < float(compression) <= 1:
        raise ValueError(
            "compression must be None (the run's own) or a ratio in (0, 1] (bytes on the wire / gradient bytes), "
            f"got {compression!r}"
        )
    r = float(compression)
    if measured is None:
        if r < 1:
            not_used.append("the hook's encode time: the run did not compress; none assumed")
        return r, 0.0
    used.append(
        f"compression: ratio {r:g} as given, encode {measured['encode_s']:.3g} s measured ({measured['source']})"
    )
    return r, float(measured["encode_s_per_byte"])


def _here(run, given, lk, here) -> tuple[bool, str]:
    """(was the link measured where the run ran, why): a Profile of the run's host and backend; `here` overrides;
    a public nccl-tests output never was."""
    if here is not None:
        return bool(here), "as given (here=)"
    if lk.origin == "nccl-tests":
        return False, "a public nccl-tests output: another system's collectives, each timed alone"
    meta = getattr(given, "meta", None)
    if meta is None:
        return False, "a Link says nothing of where it was measured (pass here=True if on the run's machine)"
    res = run.resolved
    same = meta.get("host") == res.get("host") and meta.get("backend") == res.get("backend")
    where = f"host {meta.get('host')!r}, {meta.get('backend')}"
    return same, f"the profile was calibrated on {where}; the run ran on host {res.get('host')!r}, {res.get('backend')}"


def _inputs(run, given, link, here: bool, why_here: str, nproc_total: int) -> tuple[dict, list, list]:
    """whatif's keyword arguments from the run, and the lines used / not used."""
    used, not_used = [], []
    base = run.baseline_steps
    if base is None or base.empty:
        not_used.append(f"no-op hook baseline steps: {run.path} has none (RunConfig baseline_steps); compute estimated")
    compute = wi.compute_from_run(run)
    used.append(
        f"compute: forward {compute['t_fwd'] * 1e3:.4g} ms, backward {compute['t_bwd_comp'] * 1e3:.4g} ms, "
        f"optimizer {compute['t_opt'] * 1e3:.4g} ms per rank ({compute['source']})"
    )
    kw = {"ready_curve": compute.get("ready_curve")}
    if kw["ready_curve"] is not None:
        used.append("bucket readiness: the run's measured ready curve (fraction of backward at each byte)")
    else:
        not_used.append("bucket readiness: no buckets recorded; backward spread over the buckets by bytes")
    cpu = compute.get("cpu")
    if cpu is not None and here:
        load = machine_load(run) or {}
        cpu = dict(cpu, other_cores=float(load.get("other_cores") or 0.0))
        alone = ((getattr(given, "meta", None) or {}).get("load") or {}).get("alone")
        if alone:
            cpu["alone"] = alone
        used.append(
            f"cores: {cpu['nproc']} ranks shared {cpu['cores']} CPU cores, other processes "
            f"{cpu['other_cores']:.2f} cores' worth while it ran; compute scaled by the fair share at "
            f"{nproc_total} rank(s)" + (f", a rank alone {alone['ratio']:.2f}x (the profile's passes)" if alone else "")
        )
        if not alone:
            not_used.append("a rank's compute alone: the link's calibration timed no pass alone; the fair share")
        kw["cpu"] = cpu
    elif link.origin == "nccl-tests" and not here:
        used.append(
            "compute on a device of its own per rank, independent of the rank count: the link is another system's "
            "(the run's shared CPU cores, load and measured wait describe this machine, so they do not carry over)"
        )
    elif cpu is not None:
        not_used.append(
            f"the run's shared CPU cores and load: the link is not the run's machine ({why_here}); "
            "compute taken as a device per rank, independent of the rank count"
        )
    if here:
        link = _bounded_sharing(run, link, compute, used)
        w = wi.measured_wait(run, link, compute)
        kw["wait"] = w["wait"]
        (used if w["pairs"] else not_used).append(f"measured wait: {w['wait'] * 1e3:.3g} ms ({w['source']})")
    elif link.origin != "nccl-tests":  # a public link: said once, with the cores, above
        not_used.append(f"measured wait: it belongs to the run's own transport ({why_here})")
    return dict(kw, compute=compute, link=link), used, not_used


def _bounded_sharing(run, link, compute, used: list):
    """`link` with its contention and stretch scaled toward none (contention 1 + f (c - 1), stretch f s, f in
    [0, 1]) where, at the run's own setting, they predict more exposed time than the run's paired steps measured
    (training step - no-op hook step): the run's own measurement bounds what the calibration's sharing figures
    add. `link` unchanged where they do not, or where there is nothing to scale or no paired step."""
    w = wi.measured_wait(run, link, compute)
    if not w["pairs"] or w["wait"] > 0 or (link.stretch == 0 and link.contention == 1):
        return link
    c, s, ci = link.contention, link.stretch, getattr(link, "stretch_ci", None)

    def scaled(f):
        out = link.replace(contention=1 + f * (c - 1), stretch=f * s)
        return out.replace(stretch_ci=(f * ci[0], f * ci[1])) if ci else out

    lo, hi = 0.0, 1.0
    if wi.measured_wait(run, scaled(0.0), compute)["predicted_exposed"] >= w["measured_exposed"]:
        hi = 0.0  # even idle prices reach it: none of the sharing figures is left
    for _ in range(30 if hi > 0 else 0):  # predicted exposed time grows with f
        mid = 0.5 * (lo + hi)
        lo, hi = (
            (mid, hi)
            if wi.measured_wait(run, scaled(mid), compute)["predicted_exposed"] < w["measured_exposed"]
            else (lo, mid)
        )
    out = scaled(lo)
    used.append(
        f"sharing bounded by the run: the link's contention {c:.3g}x and stretch {s:.3g} predict "
        f"{w['predicted_exposed'] * 1e3:.4g} ms exposed at the run's own setting against "
        f"{w['measured_exposed'] * 1e3:.4g} ms its paired steps measured; scaled to contention "
        f"{out.contention:.3g}x, stretch {out.stretch:.3g}"
    )
    return out


def whatif(
    run,
    link,
    *,
    bucket_mb: float | None = None,
    nproc: int | None = None,
    nodes: int | None = None,
    compression: float | None = None,
    here: bool | None = None,
) -> WhatIf:
    """Predict `run`'s DDP step at another bucket cap (MiB), rank count per node (`nproc`), node count or
    compression ratio (bytes on the wire / gradient bytes, in (0, 1]), from everything the run measured and
    `link`: a Profile (any source), a Link or a TwoLevelLink. Defaults: the run's own setting. `here`: whether the
    link was measured on the run's machine (default: a Profile of the run's host and backend); only then do the
    run's shared cores, load and measured wait apply. Returns a :class:`WhatIf`. See the module docstring."""
    run = getattr(run, "run", run)  # a RecordedRun holds its Run
    if run.spec.bucket_op != "all_reduce" or run.config.sync.local_sgd:
        raise ValueError(f"run: the what-if models DDP's all-reduced buckets; strategy {run.spec.name!r} is not one")
    if not run.resolved.get("param_nbytes"):
        raise ValueError(f"run {run.path} recorded no gradient sizes (param_nbytes) to bucket")
    lk = as_link(link)
    cap = float(run.config.ddp.bucket_mb) if bucket_mb is None else bucket_mb
    ok = isinstance(cap, (int, float)) and not isinstance(cap, bool) and math.isfinite(float(cap)) and cap > 0
    if not ok:
        raise ValueError(f"bucket_mb must be a number > 0 (MiB, DDP's bucket_cap_mb), got {bucket_mb!r}")
    per_node = _positive_int("nproc", int(run.config.nproc or run.nproc) if nproc is None else nproc, "ranks per node")
    n_nodes = _positive_int("nodes", int(run.resolved.get("nnodes") or 1) if nodes is None else nodes, "nodes")
    if isinstance(lk, TwoLevelLink) and n_nodes > 1 and per_node != lk.gpus_per_node:
        raise ValueError(
            f"nproc must equal the two-level link's gpus_per_node ({lk.gpus_per_node}) across nodes, got {per_node}"
        )
    total = per_node * n_nodes
    same, why_here = _here(run, link, lk, here)
    kw, used, not_used = _inputs(run, link, lk, same, why_here, total)
    ratio, encode = _ratio(run, compression, used, not_used)
    public = " (a public nccl-tests output: the collective as that system measured it, alone)"
    used.append(f"link: {lk.source}" + (public if lk.origin == "nccl-tests" else ""))
    used += [f"link {h}" for h in lk.how]
    if n_nodes > 1 and isinstance(lk, Link):
        not_used.append("a second level: one Link prices every hop alike across nodes (a TwoLevelLink has both)")
    compute, lk = kw.pop("compute"), kw.pop("link")
    sizes = list(reversed(run.resolved["param_nbytes"]))
    args = (compute["t_fwd"], compute["t_bwd_comp"], compute["t_opt"], sizes, float(cap), total)

    def step(lnk):
        return wi.whatif(*args, lnk, ratio, encode, **kw)

    r = step(lk)
    lo, hi = {}, {}
    ends = lk.bounds()
    if ends is None:
        band = "none: the link has no interval for alpha and beta (a Link by hand, or a fit without one)"
    else:
        fast, slow = step(ends[0]), step(ends[1])
        lo = {k: min(fast[k], slow[k]) for k, _ in QUANTITIES}
        hi = {k: max(fast[k], slow[k]) for k, _ in QUANTITIES}
        band = "the link's fitted intervals of alpha and beta (and stretch, where fitted) pushed through the step"
    setting = {
        "bucket_mb": float(cap),
        "nproc": per_node,
        "nodes": n_nodes,
        "ranks": total,
        "ratio": ratio,
        "here": same,
    }
    return WhatIf(
        t_step=float(r["t_step"]),
        t_comp=float(r["t_comp"]),
        t_comm=float(r["t_comm"]),
        exposed=float(r["exposed"]),
        lo=lo,
        hi=hi,
        band=band,
        setting=setting,
        used=used,
        not_used=not_used,
        link=lk,
        detail=r,
    )


def whatif_table(run, link, configs, **kw) -> pd.DataFrame:
    """:func:`whatif` of `run` at each (nproc, bucket_mb) of `configs`, one row each: label, nproc, bucket_mb (MiB),
    n_buckets, t_comp, t_comm, exposed, t_step (s), overlap (fraction; NaN without communication), t_step_lo and
    t_step_hi (s; NaN without a band). `kw`: whatif's nodes, compression and here. `attrs["used"]` and
    `attrs["not_used"]` hold the first configuration's input lines. Ready for
    dtlab.viz.model_plots.predicted_breakdown_figure."""
    rows, first = [], None
    for nproc, bucket_mb in configs:
        w = whatif(run, link, nproc=int(nproc), bucket_mb=float(bucket_mb), **kw)
        first = first or w
        d = w.detail
        rows.append(
            {
                "label": wi.config_label(nproc, bucket_mb),
                "nproc": int(nproc),
                "bucket_mb": float(bucket_mb),
                "n_buckets": d["n_buckets"],
                "t_comp": w.t_comp,
                "t_comm": w.t_comm,
                "exposed": w.exposed,
                "t_step": w.t_step,
                "overlap": d["overlap"],
                "t_step_lo": w.lo.get("t_step", math.nan),
                "t_step_hi": w.hi.get("t_step", math.nan),
            }
        )
    df = pd.DataFrame(rows)
    if first is not None:
        df.attrs.update(used=list(first.used), not_used=list(first.not_used), band=first.band)
    return df
