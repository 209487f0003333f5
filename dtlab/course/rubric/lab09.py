"""Lab 9 (does it still learn?): which lever reaches the target accuracy first here, local SGD's bytes, the
asynchronous server's staleness, PowerSGD's steps, local SGD's steps at the baseline's T_step, and which lever the model
says reaches the target first on another machine."""

from __future__ import annotations

from dtlab.course.claims.lab09 import steps_or_more
from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key
from dtlab.model.convergence import first_to_target, lever_from_run, time_to_target
from dtlab.model.link import Link
from dtlab.model.whatif import compute_from_run
from dtlab.results.convergence import bytes_per_step

LAB = "09_does_it_still_learn"
TARGET = 0.9
H = 5  # local SGD's period
#: the lab's settings on top of lab_config(): quick mode (tiny model) and full mode
FIELDS = {
    True: dict(steps=90, warmup=2, baseline_steps=2, batch_size=32, lr=3e-3, eval_every=5),
    False: dict(steps=1000, warmup=5, baseline_steps=3, lr=5e-5, eval_every=100),
}
LABELS = ("baseline", f"local SGD H={H}", "async", "PowerSGD r=1")
#: the other machine of question 6: p ranks, a 1 Gbit/s link (0.125 GB/s) with 50 us latency
OTHER = dict(nproc=8, bandwidth_gbs=0.125, alpha=50e-6)


def base(cfg):
    """The lab's baseline from lab_config(**FIELDS[quick]): lr tuned for DDP's global batch, scaled by the square-root
    rule for the levers whose updates see fewer sentences."""
    return cfg.replace(lr_scaling="sqrt", base_batch=cfg.batch_size * cfg.nproc)


def configs(cfg) -> dict:
    """The lab's four runs of `cfg` (base(lab_config(**FIELDS[quick]))), by label: every synchronous lever on cfg.nproc
    ranks, the asynchronous server with one more rank (cfg.nproc workers)."""
    return dict(
        zip(
            LABELS,
            (
                cfg,
                cfg.replace(local_sgd=H, baseline_steps=0),
                cfg.replace(strategy="async", nproc=cfg.nproc + 1, baseline_steps=0),
                cfg.replace(comm_hook="powersgd", powersgd_rank=1, baseline_steps=0),
            ),
        )
    )


def sources(rec) -> dict:
    """The four lever runs, from one seed."""
    return {
        "runs": lambda: {
            label: rec.run(c, f"lab 9's {label!r} run")
            for label, c in configs(base(rec.lab_config(**FIELDS[rec.quick]))).items()
        }
    }


def _need(runs):
    missing = [k for k in LABELS if k not in runs]
    if missing:
        raise ValueError(f"runs: lab 9's checks need the runs labelled {list(LABELS)}; missing {missing}")
    return runs


def _first(runs) -> Key:
    """Every lever whose target crossing could have come first: its time to target minus the training time since
    its previous evaluation (when it might have crossed) is not after the fastest one's time."""
    runs = _need(runs)
    times = {k: runs[k].time_to(TARGET) for k in LABELS}
    reached = {k: t for k, t in times.items() if t is not None}
    if not reached:
        return Key(
            "lab09.q1",
            "choice",
            "none of them",
            points=2,
            choices=LABELS + ("none of them",),
            tol_source="no run reached the target",
            hint=f"look for the first evaluation at or above {TARGET:g}",
        )
    best = min(reached, key=reached.get)
    right = []
    for k, t in reached.items():
        ev = runs[k].evals
        before = ev[ev["t"] < t]["t"]
        earliest = float(before.iloc[-1]) if len(before) else 0.0
        if earliest <= reached[best]:
            right.append(k)
    return Key(
        "lab09.q1",
        "choice",
        right,
        points=2,
        choices=LABELS + ("none of them",),
        tol_source="accuracy is read every eval_every steps: every lever that may have crossed the target "
        "before the fastest one's reading counts as right",
        explanation=f"{best} at {reached[best]:.2f} s of training; within the evaluation interval: {right}",
        hint=f"run.time_to({TARGET}) of each run: training time until its first evaluation at or above it",
    )


def _local_bytes(runs) -> Key:
    runs = _need(runs)
    frac = bytes_per_step(runs[LABELS[1]]) / bytes_per_step(runs["baseline"])
    return Key(
        "lab09.q2",
        "number",
        frac,
        abs_tol=0.01,
        tol_source="exact byte counts; 0.01 allows a rounded fraction",
        hint=f"local SGD all-reduces every parameter once per H = {H} steps; DDP every gradient every step",
        ratio_hints={1 / frac**2 if frac else 1.0: "you gave H: the question asks for the fraction"},
    )


def _staleness(runs) -> Key:
    runs = _need(runs)
    u = runs["async"].updates
    mean = float(u[u["applied"].astype(bool)]["staleness"].mean())
    return Key(
        "lab09.q3",
        "number",
        mean,
        abs_tol=0.25,
        unit="updates",
        tol_source="0.25 updates: the staleness depends on how the workers' steps interleave on the shared "
        "cores (quick runs here ranged about 0.9 to 1.0 with 2 workers)",
        hint="while one worker computes its gradient, how many updates do the other workers make?",
    )


def _composed(runs) -> Key:
    """Local SGD's steps to the target at the baseline's median T_step: a product of one lever's steps and another's
    step time, printed nowhere before the question (each run's own steps x T_step is close to its measured time to
    target, which the lab prints)."""
    runs = _need(runs)
    local = LABELS[1]
    steps = runs[local].steps_to(TARGET)
    if steps is None:
        raise ValueError(f"the {local} run never reached {TARGET:g}: no steps to compose")
    t_step = float(runs["baseline"].summary().set_index("quantity").loc["T_step", "value"])
    return Key(
        "lab09.q5",
        "number",
        steps * t_step,
        points=2,
        rel_tol=0.01,
        unit="s",
        tol_source=f"the {local} run's steps to target (exact) and the baseline's median T_step (printed to 0.01 ms); "
        "1% allows rounding them",
        hint=f"multiply the {local} run's steps to the target by the baseline's median T_step (in seconds)",
        ratio_hints={1e3: "T_step is in seconds in the data: you multiplied by milliseconds"},
    )


def _curve_times(runs) -> list[float]:
    """What the lab draws and prints above question 5, in seconds: every evaluation's training time of every lever
    (the learning curves against time; the table's measured times to target are among them). Local SGD's steps x
    the baseline's T_step lies near the baseline's own time at that step, which the curve shows by design: the
    composition's point is that it is no lever's measured time."""
    return [float(t) for run in _need(runs).values() for t in run.evals["t"]]


def _powersgd(runs) -> Key:
    runs = _need(runs)
    sp, _ = steps_or_more(runs["PowerSGD r=1"], TARGET)
    sb, _ = steps_or_more(runs["baseline"], TARGET)
    every = int(runs["baseline"].config.evaluation.every or 1)
    ans = "about the same" if abs(sp - sb) <= every else ("more" if sp > sb else "fewer")
    return Key(
        "lab09.q4",
        "choice",
        ans,
        choices=("fewer", "about the same", "more"),
        tol_source=f"steps within one evaluation interval ({every}) count as about the same",
        explanation=f"PowerSGD {sp} steps, the uncompressed run {sb} (a run that never reached it counts as "
        "one interval past its end)",
        hint="compare run.steps_to(TARGET) of the two runs",
    )


def model_inputs(runs) -> dict:
    """What the time-to-target model takes from the runs: the levers (measured steps), T_comp and the optimizer
    step of the baseline (its no-op baseline steps: compute only), the gradient bytes."""
    runs = _need(runs)
    base = runs["baseline"]
    comp = compute_from_run(base)
    return {
        "levers": [lever_from_run(k, runs[k], TARGET) for k in LABELS],
        "t_comp": comp["t_fwd"] + comp["t_bwd_comp"] + comp["t_opt"],
        "t_apply": comp["t_opt"],
        "nbytes": float(base.resolved["grad_bytes"]),
        "source": comp["source"],
    }


def _other_machine(runs) -> Key:
    m = model_inputs(runs)
    table = time_to_target(
        m["levers"],
        t_comp=m["t_comp"],
        nbytes=m["nbytes"],
        nproc=OTHER["nproc"],
        link=Link(alpha=OTHER["alpha"], beta=1 / (OTHER["bandwidth_gbs"] * 1e9)),
        t_apply=m["t_apply"],
    )
    first = first_to_target(table) or "none of them"
    return Key(
        "lab09.q6",
        "choice",
        first,
        points=2,
        choices=LABELS + ("none of them",),
        tol_source="derived: dtlab.model.convergence.time_to_target with this lab's measured steps and T_comp",
        explanation=f"the model's times: {', '.join(f'{r.label} {r.time:.3g} s' for r in table.itertuples())}",
        hint="time_to_target(levers, t_comp=..., nbytes=..., nproc=8, link=dtlab.Link(alpha=50e-6, beta=1 / 0.125e9))",
    )


QUESTIONS = (
    Question("lab09.q1", 2, "my_first_here", ("runs",), _first),
    Question("lab09.q2", 1, "my_local_bytes_fraction", ("runs",), _local_bytes),
    Question("lab09.q3", 1, "my_mean_staleness", ("runs",), _staleness),
    Question("lab09.q4", 1, "my_powersgd_steps", ("runs",), _powersgd),
    Question("lab09.q5", 2, "my_local_steps_x_baseline_t_step", ("runs",), _composed, _curve_times, ("runs",)),
    Question("lab09.q6", 2, "my_first_on_a_slow_link", ("runs",), _other_machine),
)
