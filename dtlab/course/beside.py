"""The same job on real hardware, beside the student's own: what labs 1, 2 and 4 print under a CPU run.

A student on a laptop measures CPU figures. dtlab ships runs of the labs' full-mode jobs recorded on a GPU
(dtlab.results.recorded); these tables set them beside the student's run or calibration, labelled with where they
ran (placement, versions, date), and say where the student's job differs from the recorded one. On a GPU the
student's numbers are the real thing: one line then says where the record is.

- `beside(runs)`: a run, or {label: run}, beside the recorded run of the same strategy: T_step, T_comp, T_comm,
  exposed, overlap, bytes and collective calls a rank-step.
- `beside_calibration(profile)`: the student's fitted alpha and bus bandwidth per op beside the recorded fits.
- `beside_nccl_tests(profile)`: the student's fit beside a real box's posted nccl-tests curve, and what differs.
"""

from __future__ import annotations

import math
import textwrap
from operator import attrgetter

from dtlab.course.wording import kind
from dtlab.model import costmodel
from dtlab.results.nccl_profile import public_nccl_tests
from dtlab.results.recorded import (
    RecordedRun,
    bus_bandwidth,
    provenance_line,
    recorded_calibration,
    recorded_run,
    run_figures,
)
from dtlab.units import fmt_bytes, fmt_count, fmt_gbps, fmt_ms, fmt_us

#: the recorded run each strategy is set beside (DistilBERT, 2 ranks, batch 8 x 64 per rank: the labs' full mode on
#: a CPU machine)
RECORDED_FOR = {"ddp": "h200-ddp", "zero3": "h200-zero3"}
#: config fields that make two runs the same job (a bucket cap, ddp.bucket_mb, only where buckets are recorded)
SAME_JOB = ("model", "nproc", "batch_size", "seq_len")
ROWS = (
    ("T_step", "T_step_ms", "ms"),
    ("T_comp", "T_comp_ms", "ms"),
    ("T_comm", "T_comm_ms", "ms"),
    ("exposed", "exposed_ms", "ms"),
    ("overlap", "overlap", "ratio"),
    ("bytes a rank-step (B)", "bytes_per_rank_step", "count"),
    ("collective calls a rank-step", "calls_per_rank_step", "count"),
)
WIDTH = 116  # characters a line of these tables' notes is wrapped at


def _note(head: str, text: str) -> list[str]:
    """`text` wrapped under `head` ('  there: '), continuation lines indented to match."""
    return textwrap.wrap(text, WIDTH, initial_indent=head, subsequent_indent=" " * len(head))


def _cell(value, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit == "ms":
        return fmt_ms(value / 1e3)
    return f"{value:.2f}" if unit == "ratio" else fmt_count(value)


def _on_cpu(resolved_or_meta: dict) -> bool:
    placed = resolved_or_meta.get("placement") or {}
    device = resolved_or_meta.get("device_type") or placed.get("device")
    return device != "cuda"


def differences(run, rec: RecordedRun) -> list[str]:
    """How `run`'s job differs from the recorded one: ['model tiny here, distilbert there', ...] (empty: the same)."""
    fields = SAME_JOB + (("ddp.bucket_mb",) if run.spec.records == "buckets" else ())
    out = []
    for f in fields:
        mine, theirs = attrgetter(f)(run.config), attrgetter(f)(rec.run.config)
        if mine != theirs:
            out.append(f"{f} {mine} here, {theirs} there")
    return out


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    return [
        "  " + "   ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header] + rows
    ]


def beside(runs) -> str:
    """`runs` (a Run, or {label: Run}) beside the recorded runs of the same strategies, as aligned text: when the
    runs ran on a CPU; otherwise one line saying where the record is. A strategy with no recorded run is left out."""
    if not isinstance(runs, dict):
        runs = {run_label(runs): runs}
    pairs = [(label, run, RECORDED_FOR.get(run.config.strategy)) for label, run in runs.items()]
    pairs = [(label, run, name) for label, run, name in pairs if name]
    if not pairs:
        return "no recorded run of this strategy ships with dtlab (dtlab.recorded_runs() lists them)"
    names = ", ".join(f'dtlab.recorded_run("{name}")' for _, _, name in pairs)
    if not all(_on_cpu(run.resolved) for _, run, _ in pairs):
        if any(kind(run.resolved.get("placement") or {}) == "host_staged" for _, run, _ in pairs):
            return (
                f"your runs ran on a GPU through gloo, like the recording: compute is GPU compute, communication "
                f"is staged through host memory (dtlab.course.wording.nccl_beside prices it over NCCL). "
                f"Recorded on an H200 for comparison: {names}."
            )
        return f"your runs ran with NCCL on GPUs: they are the real thing. Recorded on an H200 for comparison: {names}."
    recs = {name: recorded_run(name) for _, _, name in pairs}
    prov = next(iter(recs.values())).provenance
    mine = {label: run_figures(run) for label, run, _ in pairs}
    theirs = {label: run_figures(recs[name].run) for label, _, name in pairs}
    header = [""] + [f"{label}, yours" for label in mine] + [f"{label}, H200" for label in theirs]
    rows = [
        [q] + [_cell(mine[lb][key], unit) for lb in mine] + [_cell(theirs[lb][key], unit) for lb in theirs]
        for q, key, unit in ROWS
    ]
    here = sorted(
        {run.resolved.get("placement", {}).get("label", run.resolved.get("backend", "?")) for _, run, _ in pairs}
    )
    lines = [f"The same job on {prov['machine']['name']}, recorded there ({names}):"]
    lines += _note(
        "  there: ",
        f"{provenance_line(prov)}. {prov['placement_why']}. DistilBERT with random weights "
        "and generated sentences (no network there): the same bytes and buckets as the pretrained model.",
    )
    lines += _note("  here:  ", "; ".join(here))
    lines += _table(header, rows)
    ratio = [f"{lb}: {_ratio(mine[lb])} here, {_ratio(theirs[lb])} there" for lb in mine]
    lines += _note("  ", "T_comm / T_comp: " + "; ".join(ratio))
    for label, run, name in pairs:
        diff = differences(run, recs[name])
        if diff:
            lines += _note(
                "  ",
                f"{label}: not the same job ({'; '.join(diff)}): quick mode runs the tiny model; "
                "the lab's full mode on a CPU runs the recorded job.",
            )
    return "\n".join(lines)


def _ratio(fig: dict) -> str:
    comm, comp = fig["T_comm_ms"], fig["T_comp_ms"]
    return f"{comm / comp:.1f}" if comp > 0 and comm == comm and comp == comp else "n/a"


def run_label(run) -> str:
    """'DDP', 'ZeRO-3', ...: the strategy as the labs name it."""
    strategy = run.config.strategy
    return {"ddp": "DDP", "zero3": "ZeRO-3"}.get(strategy, str(strategy))


def beside_calibration(profile, name: str = "h200-calibration") -> str:
    """The student's fitted alpha and bus bandwidth per op beside the recorded calibration's (aligned text), when
    the profile was measured on a CPU; otherwise one line saying where the record is."""
    if not _on_cpu(profile.meta):
        return (
            f"your calibration ran on GPUs: it is the real thing. Recorded on an H200 for comparison: "
            f'dtlab.recorded_calibration("{name}").'
        )
    rec = recorded_calibration(name)
    p_rec = int(rec.provenance["nproc"])
    p_mine = int(profile.meta.get("world_size") or p_rec)
    ops = sorted(set(profile.fits) | set(rec.profile.fits))

    def us(f):
        return f"{f.alpha * 1e6:.1f} us" if f is not None else "n/a"

    def bw(f, p):
        if f is None:
            return "n/a"
        return f"{bus_bandwidth(f, p) / 1e9:.3g} GB/s" if f.beta > 0 else "inf"

    def rms(f):
        return f"{f.rel_rms:.2f}" if f is not None and f.rel_rms == f.rel_rms else "n/a"

    rows = []
    for op in ops:
        mine, theirs = profile.fits.get(op), rec.profile.fits.get(op)
        rows.append([op, us(mine), us(theirs), bw(mine, p_mine), bw(theirs, p_rec), rms(mine), rms(theirs)])
    header = ["", "alpha, yours", "alpha, H200", "bus bw, yours", "bus bw, H200", "rel. RMS, yours", "rel. RMS, H200"]
    forms = sorted({f.form for f in profile.fits.values()} | {f.form for f in rec.profile.fits.values()})
    sizes = (
        f"{min(f.min_bytes for f in profile.fits.values()):,}..{max(f.max_bytes for f in profile.fits.values()):,}"
        if profile.fits
        else "?"
    )
    lines = [
        f"The same calibration on {rec.provenance['machine']['name']}, recorded there "
        f'(dtlab.recorded_calibration("{name}")):'
    ]
    lines += _note(
        "  there: ",
        f"{provenance_line(rec.provenance)}; sizes {rec.provenance['min_bytes']:,}.."
        f"{rec.provenance['max_bytes']:,} B. {rec.provenance['placement_why']}. Fitted figures only: the "
        "samples behind them did not come back from the machine.",
    )
    here = (profile.meta.get("placement") or {}).get("label", profile.meta.get("backend", "?"))
    lines += _note("  here:  ", f"{here}; sizes {sizes} B")
    lines += _table(header, rows)
    lines += _note(
        "  ",
        f"form: {' and '.join(forms)}; bus bandwidth: nccl-tests' busbw of a message large enough "
        "to hide alpha"
        + ("; the two forms' alphas differ by their latency steps: compare like with like" if len(forms) > 1 else ""),
    )
    return "\n".join(lines)


#: the real box lab 2 sets a calibration beside: one 8-GPU NVSwitch machine's posted nccl-tests curve
NCCL_BOX = "aws-p5-1x8-h100-nvswitch"


def _size(n: float) -> str:
    return fmt_bytes(n) if math.isfinite(n) else "n/a"


def _ends(profile, op: str):
    """(the smallest sizes' regime, the largest sizes' regime, ranks) of a profile's piecewise fit of op."""
    segs = profile.segments.get(op) or [profile.fits[op]]
    return segs[0], segs[-1], int(profile.meta.get("world_size") or max(segs[-1].nprocs or [2]))


def beside_nccl_tests(profile, name: str = NCCL_BOX, op: str = "all_reduce") -> str:
    """The student's alpha-beta fit of `op` beside a real box's nccl-tests curve (dtlab.public_nccl_tests(name)):
    alpha of the smallest sizes' regime, 1/beta of the largest sizes' regime, the size where the two terms are
    equal, the number of regimes; then what the differences mean. Every figure comes from the two fits."""
    real = public_nccl_tests(name)
    system = real.meta["source"]["system"]
    rows, figures = [], {}
    for who, prof in (("yours", profile), ("real box", real)):
        small, large, p = _ends(prof, op)
        a, b = costmodel.coefficients(op, large.form, p)
        # the size where latency and bandwidth terms are equal: A(p) alpha = B(p) n beta
        half = float(a * small.alpha / (b * large.beta)) if large.beta > 0 else float("inf")
        figures[who] = (small.alpha, large.beta, half, p)
        rows.append(
            [
                who,
                str(p),
                fmt_us(small.alpha),
                fmt_gbps(1 / large.beta) if large.beta > 0 else "inf",
                _size(half),
                str(len(prof.segments.get(op) or [])),
            ]
        )
    header = ["", "ranks", "alpha (small sizes)", "1/beta (large sizes)", "alpha = beta term at", "regimes"]
    lines = _note(
        "",
        f"Your {op} fit beside a real box's nccl-tests curve, {system['name']}: {system['gpus']} {system['gpu']} on "
        f'{system["nodes"]} node(s), {system["interconnect"]} (dtlab.public_nccl_tests("{name}"))',
    )
    lines += _note("  source: ", f"{system['source']} (posted {system['posted']}; {system['licence']})")
    lines += _table(header, rows)
    (ya, yb, yh, yp), (ra, rb, rh, rp) = figures["yours"], figures["real box"]
    bw = f"{yb / rb:.3g}x" if yb > 0 and rb > 0 else "n/a"
    lines += _note(
        "  what it means: ",
        f"a large message moves {bw} faster per byte there (1/beta, the bandwidth term, which busbw makes "
        f"comparable across rank counts); a ring step starts {ya / ra:.3g}x sooner there (alpha), but an "
        f"all-reduce pays 2(p-1) steps: {2 * (rp - 1)} on its {rp} ranks, {2 * (yp - 1)} on your {yp}. Below the "
        f"size where the two terms are equal ({_size(rh)} there, {_size(yh)} here) a message is latency-bound: "
        "a DDP bucket below it pays mostly alpha, and more buckets cost more than bytes do. The real curve "
        "climbs through several regimes because NCCL switches protocol (LL, LL128, Simple) and algorithm "
        "(ring, tree, NVLink SHARP) with size; one straight line would miss it by tens of percent "
        "(docs/nccl-tests.md).",
    )
    return "\n".join(lines)
