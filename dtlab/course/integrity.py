"""Is a recorded run what it claims to be? Consistency checks the autograder runs before it trusts a recording,
and the check-cell fingerprints that tell whether a submission changed the distributed check cells.

A run (`run_problems`) must have finished; its config must be the lab's; every rank must have recorded a start,
every step and every no-op baseline step; its gradient bytes must be those of its model's architecture (computed
here, not read from the run); every DDP / ps rank-step must all-reduce exactly those bytes (ZeRO-3: reduce-scatter
the bytes its engine expects); every bucket's times must be ordered (0 <= ready <= start <= end) and inside its
step; every step's phases must add up to its T_step; each rank's events must be in time order, after the launch.
A calibration (`calibration_problems`) must have finished, match the lab's fields, time every (op, size) on every
rank of every group the same number of times, with positive finite durations, in time order.

What this catches: a run of another config, a run that stopped early or lost a rank, a hand-edited byte count
or time, events pasted from another run, an incomplete copy. What it cannot catch: a recording fabricated to be
self-consistent (right byte counts, ordered times, invented durations). Byte counts and every derived key come
from the architecture and the formulas, not from the run, so a fabricated run can move only measured keys
(times, spreads); a replayed run cannot prove which machine recorded it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re

from dtlab.config.strategies import strategy_spec
from dtlab.launching.replay import RUN_SPECIFIC, field_same, flat_fields, status_of
from dtlab.model.whatif import model_param_nbytes
from dtlab.results.calibration import samples_frame

EPS_S = 1e-6  # float noise in recorded seconds
SLACK_S = 1.0  # wall-clock slack between processes (launch time vs a rank's first event)


def _events(run_dir: str) -> dict[int, list[dict]]:
    """Raw events per rank file (a line that does not parse is skipped, as dtlab's reader does)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.jsonl"))):
        m = re.search(r"rank(\d+)\.jsonl$", path)
        evs = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict):
                    evs.append(ev)
        out[int(m.group(1))] = evs
    return out


def _time_order(run_dir: str, launch_time) -> list[str]:
    bad = []
    for rank, evs in _events(run_dir).items():
        times = [float(e["time"]) for e in evs if isinstance(e.get("time"), (int, float))]
        # A rank writes its start event first and each later one after it: order is checked by position too, so
        # a reordered file is caught even when the whole run took less than the clock slack.
        starts_first = not any(e.get("kind") == "start" for e in evs) or evs[0].get("kind") == "start"
        if not starts_first or any(b < a - SLACK_S for a, b in zip(times, times[1:])):
            bad.append(f"rank {rank}'s events are not in time order")
        if times and isinstance(launch_time, (int, float)) and times[0] < float(launch_time) - SLACK_S:
            bad.append(f"rank {rank}'s first event predates the launch")
    return bad


def _field_diff(want: dict, got: dict, defaults: dict | None) -> list[str]:
    want, got, defaults = flat_fields(want), flat_fields(got), flat_fields(defaults)
    return [
        f"{k}: the lab's {v!r}, recorded {got.get(k)!r}"
        for k, v in want.items()
        if k not in RUN_SPECIFIC and not field_same(k, v, got, defaults)
    ]


def run_problems(run, want: dict | None = None, defaults: dict | None = None) -> list[str]:
    """What is inconsistent in a loaded dtlab Run (see the module's docstring); [] when nothing. `want`: the lab's
    config fields (RunConfig.to_dict()), `defaults`: the config's defaults (for fields a recording predates)."""
    problems = []
    if run.status.get("state") != "finished":
        problems.append(f"it did not finish (state {run.status.get('state')!r})")
    if want:
        problems += [
            f"its config differs from the lab's: {d}" for d in _field_diff(want, run.config.to_dict(), defaults)
        ]
    cfg, world = run.config, run.nproc
    ranks = set(int(r) for r in run.ranks["rank"]) if not run.ranks.empty else set()
    if ranks != set(range(world)):
        problems.append(f"ranks {sorted(set(range(world)) - ranks)} of {world} left no start event")
    steps = set(range(int(cfg.steps)))
    for r in range(strategy_spec(cfg.strategy).server_ranks, world):  # an asynchronous server takes no steps
        got = set(int(s) for s in run.steps.loc[run.steps["rank"] == r, "step"])
        if got != steps:
            problems.append(f"rank {r} recorded steps {sorted(got)}, the config asks {sorted(steps)}")
        n_base = int((run.baseline_steps["rank"] == r).sum()) if not run.baseline_steps.empty else 0
        asked = cfg.measurement.baseline_steps
        if strategy_spec(cfg.strategy).compute_baseline and n_base != int(asked or 0):
            problems.append(f"rank {r} recorded {n_base} baseline steps, the config asks {asked}")
    problems += _byte_problems(run)
    problems += _timing_problems(run)
    problems += _time_order(run.path, run.status.get("started") or None)
    return problems


def _byte_problems(run) -> list[str]:
    try:
        want = int(sum(model_param_nbytes(run.config.model)))
    except (KeyError, ValueError):
        return []  # a model dtlab cannot size from its name: the labs use tiny or distilbert
    res = run.resolved
    if int(res.get("grad_bytes", -1)) != want or 4 * int(res.get("num_parameters", -1)) != want:
        return [
            f"it claims {res.get('grad_bytes')} gradient bytes ({res.get('num_parameters')} parameters); "
            f"{run.config.model}'s architecture has {want:,} B"
        ]
    spec = strategy_spec(run.config.strategy)
    records = spec.records
    if int(run.config.sync.local_sgd or 0) or spec.asynchronous:
        return _convergence_byte_problems(run, want, spec)
    if records == "buckets":
        b = run.buckets
        per = b.groupby(["rank", "step"])["nbytes"].sum() if not b.empty else b
        rank_steps = set(zip(run.steps["rank"].astype(int), run.steps["step"].astype(int)))
        if b.empty or set((int(r), int(s)) for r, s in per.index) != rank_steps:
            return ["its buckets do not cover every rank-step"]
        off = per[per != want]
        if len(off):
            return [
                f"rank {off.index[0][0]} step {off.index[0][1]} all-reduced {int(off.iloc[0]):,} B, not the "
                f"{want:,} B of its gradients"
            ]
    elif records == "collectives" and res.get("expected_bytes_per_step") is not None:
        return _op_byte_problems(run, res["expected_bytes_per_step"])
    elif records == "collectives":
        c = run.collectives
        rs = c[c["op"] == "reduce_scatter"].groupby(["rank", "step"])["nbytes"].sum() if not c.empty else c
        exp = res.get("expected_reduce_scatter_bytes_per_step")
        if c.empty or exp is None or (rs != int(exp)).any():
            return ["its reduce-scatter bytes per rank-step are not the engine's expected bytes"]
    return []


def _op_byte_problems(run, expected: dict) -> list[str]:
    """Runs that say what their layout moves per step (tp, pp, fsdp2: `expected_bytes_per_step`, op -> bytes over
    all ranks): every step's recorded bytes of each op must be exactly that."""
    c = run.collectives
    steps = set(range(int(run.config.steps)))
    for op, want in expected.items():
        got = c[(c["op"] == op) & (c["step"] >= 0)].groupby("step")["nbytes"].sum() if not c.empty else c
        if set(int(s) for s in got.index) != steps or (got != int(want)).any():
            return [f"its {op} bytes per step are not the {int(want):,} B its layout moves"]
    return []


def _convergence_byte_problems(run, want: int, spec) -> list[str]:
    """Local SGD: one average of every parameter's bytes after every H steps on every rank, nothing else; the
    asynchronous workers: one push and one pull of the gradient bytes plus the message header per step."""
    c, st = run.collectives, run.steps
    rank_steps = set(zip(st["rank"].astype(int), st["step"].astype(int)))
    if spec.asynchronous:
        header = {"push": 16, "pull": 8}
        for op, extra in header.items():
            m = c[c["op"] == op] if not c.empty else c
            if set(zip(m["rank"].astype(int), m["step"].astype(int))) != rank_steps:
                return [f"its {op} messages do not cover every worker step"]
            if (m["nbytes"] != want + extra).any():
                return [f"a {op} message carries other than the {want:,} B of the model plus its {extra} B header"]
        return []
    h = int(run.config.sync.local_sgd)
    due = {(r, s) for r, s in rank_steps if (s + 1) % h == 0 and s < int(run.config.steps)}
    avg = c[c["phase"] == "average"] if not c.empty else c
    if not run.buckets.empty or set(zip(avg["rank"].astype(int), avg["step"].astype(int))) != due:
        return [f"its parameter averages are not one after every {h} steps on every rank"]
    if (avg["nbytes"] != want).any():
        return [f"a parameter average moved other than the {want:,} B of the model"]
    return []


def _timing_problems(run) -> list[str]:
    problems = []
    st = run.steps
    if not st.empty:
        parts = st[["t_fwd", "t_bwd", "t_opt"]]
        if (parts < -EPS_S).any().any() or (st["t_step"] < -EPS_S).any():
            problems.append("a step has a negative duration")
        elif ((parts.sum(axis=1) - st["t_step"]).abs() > 1e-3 + 1e-3 * st["t_step"]).any():
            problems.append("a step's forward + backward + optimizer do not add up to its T_step")
    b = run.buckets
    if not b.empty:
        t = b[["t_ready", "t_start", "t_end"]].astype(float)
        if (
            t.isna().any().any()
            or (t["t_ready"] < -EPS_S).any()
            or (t["t_start"] < t["t_ready"] - EPS_S).any()
            or (t["t_end"] < t["t_start"] - EPS_S).any()
        ):
            problems.append("a bucket's times are out of order (0 <= ready <= start <= end)")
        else:
            ends = b.merge(st[["rank", "step", "t_step"]], on=["rank", "step"], how="left")
            if (ends["t_end"] > ends["t_step"] + 1e-3 + 0.01 * ends["t_step"]).any():
                problems.append("a bucket's all-reduce ends after its step")
    return problems


def calibration_problems(run_dir: str, want: dict | None = None) -> list[str]:
    """What is inconsistent in a calibration directory (see the module's docstring); [] when nothing."""
    with open(os.path.join(run_dir, "config.json")) as f:
        doc = json.load(f)
    cal = doc.get("calibration", {})
    problems = []
    state = status_of(run_dir, cal).get("state")
    if state != "finished":
        problems.append(f"it did not finish (state {state!r})")
    if want:
        problems += [f"its config differs from the lab's: {d}" for d in _field_diff(want, cal, None)]
    raw, _ = samples_frame(run_dir)
    if raw.empty:
        return problems + ["it recorded no samples"]
    if not raw["seconds"].map(lambda s: isinstance(s, (int, float)) and 0 < s < float("inf")).all():
        problems.append("a sample's duration is not a positive finite number")
    if set(raw["op"]) != set(cal.get("ops", [])) or raw["nbytes"].nunique() != len(cal.get("sizes", [])):
        problems.append(
            f"it timed ops {sorted(set(raw['op']))} at {raw['nbytes'].nunique()} sizes; the config asks "
            f"{cal.get('ops')} at {len(cal.get('sizes', []))}"
        )
    iters = set(range(int(cal.get("iters", 0))))
    for (op, n, k), g in raw.groupby(["op", "nbytes", "nproc"]):
        by_rank = {int(r): set(int(i) for i in gr["iter"]) for r, gr in g.groupby("rank")}
        if set(by_rank) != set(range(int(k))) or any(v != iters for v in by_rank.values()):
            problems.append(f"{op} at {int(n):,} B on {int(k)} ranks: not every rank timed every iteration")
            break
    launch = doc.get("launch", {}).get("time")
    return problems + _time_order(run_dir, launch)


# ---- the distributed check cells ----------------------------------------------------------------------------
#: a code cell that imports the checks (from the labs' module, dtlab.lab, or from where they live) is a check cell
CHECK_MARK = re.compile(r"^\s*from dtlab\.(?:lab|course\.checks) import\b[^\n]*\bcheck(?:_exercise)?\b", re.M)


def _norm(src) -> str:
    src = "".join(src) if isinstance(src, list) else str(src)
    return "\n".join(line.rstrip() for line in src.strip().splitlines())


def fingerprint(src) -> str:
    """sha256 of a cell's source, trailing spaces and blank edges ignored."""
    return hashlib.sha256(_norm(src).encode()).hexdigest()


def check_cells(nb: dict) -> list[dict]:
    """The check cells of a (student) notebook: {"index", "sha256", "qids"} per code cell that imports the checks
    (`CHECK_MARK`), in order."""
    out = []
    for i, c in enumerate(nb.get("cells", [])):
        src = _norm(c.get("source", ""))
        if c.get("cell_type") == "code" and CHECK_MARK.search(src):
            out.append({"index": i, "sha256": fingerprint(src), "qids": sorted(set(re.findall(r"lab\d\d\.\w+", src)))})
    return out


TOUCHES_CHECKS = (
    r"dtlab\.course\.checks|\bimport\b[^\n]*\bcheck(_number|_choice|_formula|_exercise)?\b"
    r"|_dtlab_answers|\bRECORDED\b|\bcheck(_number|_choice|_formula)?\("
)


def cell_flags(distributed: list[dict], nb: dict) -> list[str]:
    """What a submission changed in the distributed check cells: one line per check cell edited or removed, and
    per other cell that reaches into the checks or their records."""
    have = {}
    for i, c in enumerate(nb.get("cells", [])):
        if c.get("cell_type") == "code":
            have.setdefault(fingerprint(c.get("source", "")), i)
    flags = [
        f"check cell {d['index'] + 1}" + (f" ({', '.join(d['qids'])})" if d["qids"] else "") + " edited or removed"
        for d in distributed
        if d["sha256"] not in have
    ]
    known = {d["sha256"] for d in distributed}
    for i, c in enumerate(nb.get("cells", [])):
        src = _norm(c.get("source", ""))
        if c.get("cell_type") == "code" and fingerprint(src) not in known and re.search(TOUCHES_CHECKS, src):
            flags.append(f"cell {i + 1} is not a distributed cell and uses the checks")
    return flags
