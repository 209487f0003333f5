"""Lab 10 (tensor and pipeline parallelism): a tensor-parallel step's all-reduces and their bytes, the bubble of
P = 2 stages at M = 4, whether the measured bubble fell from M = 1 to M = 4, the micro-batches 1F1B's first stage
held, and the planner's fastest layout that fits for a larger model."""

from __future__ import annotations

from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key
from dtlab.model import planner
from dtlab.model.parallel import bubble_fraction
from dtlab.results.parallel import tp_collectives
from dtlab.results.pipeline import in_flight

LAB = "10_tensor_and_pipeline"
M = 4  # micro-batches of the lab's pipeline runs (and of lab10.q3)
LABELS = ("tp", "pp M=1", f"pp M={M}", f"pp M={M} 1f1b")
#: lab10.q6: the planner's setting (model, GPUs, interconnect from this machine's calibration, compute from the
#: M = 1 pipeline run)
PLANNER_Q = dict(
    model="gpt3-6.7b",
    gpus=64,
    gpus_per_node=8,
    gpu_memory_gb=80,
    global_batch=512,
    seq=2048,
    microbatches=32,
    schedule="1f1b",
    sharded=False,
)


def base(quick: bool) -> dict:
    """The lab's overrides of lab_config(): 2 ranks, 5 steps; in quick mode 32 samples of 256 tokens, so that
    compute (not gloo's per-message cost) fills the tiny model's pipeline steps."""
    return dict(nproc=2, baseline_steps=0, steps=5, warmup=1, **({"batch_size": 32, "seq_len": 256} if quick else {}))


def configs(cfg) -> dict:
    """The lab's four runs of `cfg` (lab_config(**base(quick))), by the labels the lab gives them."""
    return dict(
        zip(
            LABELS,
            (
                cfg.replace(strategy="tp", reference=True, dropout=0.0),
                cfg.replace(strategy="pp", microbatches=1),
                cfg.replace(strategy="pp", microbatches=M),
                cfg.replace(strategy="pp", microbatches=M, pp_schedule="1f1b"),
            ),
        )
    )


def sizes(quick: bool) -> list[int]:
    """The lab's calibration sizes: 4 KiB .. 1 MiB (quick) or 16 MiB."""
    return [2**k for k in range(12, 21 if quick else 25)]


def calib_fields(quick: bool) -> dict:
    return {"nproc": 2, "ops": ["all_reduce"], "sizes": sizes(quick), "iters": 3 if quick else 10}


def sources(rec) -> dict:
    """The four runs and the all-reduce calibration."""
    return {
        "runs": lambda: {
            label: rec.run(c, f"lab 10's {label!r} run")
            for label, c in configs(rec.lab_config(**base(rec.quick))).items()
        },
        "profile": lambda: rec.calibration(calib_fields(rec.quick), "lab 10's all-reduce calibration"),
    }


def _run(runs, label):
    if label not in runs:
        raise ValueError(f"runs: lab 10's checks need the runs labelled {list(LABELS)}; missing {label!r}")
    return runs[label]


def _allreduces(runs) -> Key:
    t = tp_collectives(_run(runs, "tp"))
    return Key(
        "lab10.q1",
        "number",
        float(t["count"].median()),
        points=2,
        abs_tol=0.0,
        tol_source="exact counts of the recorded all-reduces (the median rank-step)",
        hint="count per transformer block: each row-parallel layer's output in forward, each column-parallel "
        "layer's input gradient in backward",
        ratio_hints={
            0.5: "that is forward only (or backward only): both passes all-reduce",
            1.5: "q, k and v share one input: their input gradients add up before one all-reduce",
        },
    )


def _bytes(runs) -> Key:
    t = tp_collectives(_run(runs, "tp"))
    tp = int(_run(runs, "tp").resolved["layout"]["tp"])
    return Key(
        "lab10.q2",
        "number",
        float(t["bytes_min"].median()),
        points=2,
        rel_tol=0.01,
        unit="B",
        tol_source="exact byte counts (every all-reduce has the same size); 1% allows rounding",
        hint="an all-reduce sums whole activations of the block: batch x seq_len x hidden elements of 4 B",
        ratio_hints={
            0.25: "that is elements: each fp32 element is 4 bytes",
            1 / tp: "each rank all-reduces the whole activation, not its 1/t share",
            4.0: "hidden, not the feed-forward's 4 x hidden: the row-parallel layers output hidden",
        },
    )


def _theory(runs) -> Key:
    run = _run(runs, f"pp M={M}")
    p = int(run.resolved["layout"]["pp"])
    return Key(
        "lab10.q3",
        "number",
        float(bubble_fraction(p, int(run.config.parallel.microbatches))),
        abs_tol=0.005,
        tol_source="a formula; 0.005 allows rounding",
        hint="(P - 1) idle slots of the M + P - 1 in a step",
        ratio_hints={(p - 1) / p / ((p - 1) / (M + p - 1)): "that is (P-1)/P: M = 1"},
    )


def _falls(runs) -> Key:
    m1, m4 = _run(runs, "pp M=1").bubble(), _run(runs, f"pp M={M}").bubble()
    return Key(
        "lab10.q4",
        "choice",
        "yes" if m4.measured < m1.measured else "no",
        choices=("yes", "no"),
        explanation=f"measured: {m1.measured:.3f} at M = 1, {m4.measured:.3f} at M = {M} (medians over steps)",
        hint="compare the two runs' measured bubbles in the table, not the theory",
    )


def _held(runs) -> Key:
    held = in_flight(_run(runs, f"pp M={M} 1f1b")).set_index("stage")["in_flight"]
    return Key(
        "lab10.q5",
        "number",
        float(held.loc[0]),
        abs_tol=0.0,
        tol_source="exact: counted from the recorded forwards and backwards of stage 0",
        hint="1F1B starts backwards as soon as the last stage can: how many forwards run before the first "
        "backward on the first stage?",
        ratio_hints={M / float(held.loc[0]): "that is GPipe's: every micro-batch's forward before any backward"},
    )


def _planner(runs, profile) -> Key:
    q = PLANNER_Q
    table = planner.plan(
        planner.MODELS[q["model"]],
        q["gpus"],
        gpus_per_node=q["gpus_per_node"],
        gpu_memory=q["gpu_memory_gb"] * 1e9,
        global_batch=q["global_batch"],
        seq=q["seq"],
        microbatches=q["microbatches"],
        schedule=q["schedule"],
        sharded=q["sharded"],
        levels=planner.levels_from_profile(profile),
        compute=planner.compute_from_run(_run(runs, "pp M=1")),
    )
    fit = table[table["fits"]]
    best = fit.iloc[0]["layout"] if len(fit) else "none fits"
    return Key(
        "lab10.q6",
        "choice",
        best,
        choices=tuple(table["layout"]) + ("none fits",),
        explanation=f"the planner with this machine's compute and calibration: {best} predicted fastest of "
        f"{len(fit)} layouts that fit in {q['gpu_memory_gb']} GB",
        hint="set the planner's controls to the question's setting and read the label's 'fastest that fits'",
    )


QUESTIONS = (
    Question("lab10.q1", 2, "my_tp_allreduces", ("runs",), _allreduces),
    Question("lab10.q2", 2, "my_tp_bytes", ("runs",), _bytes),
    Question("lab10.q3", 1, "my_bubble_theory", ("runs",), _theory),
    Question("lab10.q4", 1, "my_bubble_falls", ("runs",), _falls),
    Question("lab10.q5", 1, "my_1f1b_held", ("runs",), _held),
    Question("lab10.q6", 1, "my_planner_fastest", ("runs", "profile"), _planner),
)
