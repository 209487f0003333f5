"""What the lab notebooks run, in one place (so no helper is copy-pasted between notebooks, and `dtlab doctor`
places each lab's ranks from the very configs the lab builds).

- `lab_config(**overrides)`: the config a lab starts from on this machine (`config_for` is the same for a
  given GPU count and mode, pure).
- `LABS` / `lab_parts(lab, ngpu, nccl)`: every run and calibration a lab starts, as configs, for the doctor.
- `machine_banner(cfg)`: the line each lab prints before it measures: GPUs, placement, how times are taken.
"""

from __future__ import annotations

import os

from dtlab.config.placement import device_count
from dtlab.config.run import RunConfig, tiny
from dtlab.launching.replay import recorded_machine, replay_root


def quick_mode() -> bool:
    """True when DTLAB_QUICK=1: labs use the tiny model and few steps (tests, Binder, a first look). When
    grading a submission (DTLAB_REPLAY), the mode its runs were recorded in."""
    rec = recorded_machine()
    if rec is not None:
        return rec["quick"]
    return os.environ.get("DTLAB_QUICK", "0") == "1"


def _gpus() -> int:
    """GPUs of this machine, or of the recorded machine when grading a submission (DTLAB_REPLAY)."""
    rec = recorded_machine()
    return rec["gpus"] if rec is not None else device_count()


def config_for(ngpu: int, quick: bool, **overrides) -> RunConfig:
    """The config a lab starts from on a machine with `ngpu` GPUs (pure: nothing is asked of the machine).

    Quick mode: the tiny preset, 2 ranks. Full mode: DistilBERT, one rank per GPU and at least 2. Every strategy,
    ZeRO-3 included, is placed by `dtlab.config.placement`: on one GPU the 2 ranks share it (NCCL >= 2.30; before
    that gloo on CUDA tensors, and DeepSpeed is given the GPU's index as LOCAL_RANK), so a lab compares ZeRO-3
    and DDP at the same p >= 2 on every machine."""
    if quick:
        return tiny(**{"bucket_mb": 0.05, "steps": 4, "baseline_steps": 2, **overrides})
    base = dict(
        model="distilbert",
        nproc=max(2, ngpu),
        steps=8,
        warmup=2,
        baseline_steps=3,
        batch_size=32 if ngpu else 8,
        seq_len=128 if ngpu else 64,
        bucket_mb=25.0,
    )
    base.update(overrides)
    return RunConfig(**base)


def lab_config(**overrides) -> RunConfig:
    """The config a lab starts from: DistilBERT on whatever this machine has, or the tiny preset in quick
    mode (see `config_for`). When grading a submission, the machine it was recorded on."""
    return config_for(_gpus(), quick_mode(), **overrides)


def attempt(what: str, start, needed_by: str = ""):
    """`start()` (a run or a calibration), or None when it fails, with one clear line instead of a traceback:
    what failed, why (the error's first line), and what still runs, so a failed run takes only its own section
    down and Run All goes on to the next one. `needed_by`: the later parts that need it ("question 1 and the
    planner"). KeyboardInterrupt is not caught."""
    try:
        return start()
    except Exception as e:  # noqa: BLE001 - a lab section reports any failure of its run and goes on
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(
            f"{what} failed: {type(e).__name__}: {first[:400]}\n"
            f"  the parts that need it{' (' + needed_by + ')' if needed_by else ''} say so and are skipped; "
            "the next sections do not need it and still run."
        )
        return None


def calibration_ranks(cfg: RunConfig) -> int:
    """Ranks for a calibration that prices `cfg`'s runs: its own rank count, at least 2 (a collective needs
    peers; on one GPU 2 ranks share it as the runs' ranks do)."""
    return max(2, int(cfg.nproc or 2))


# ---- every lab's runs, for `dtlab doctor` ---------------------------------------------------------------


def _cal(nproc: int, backend: str = "auto") -> RunConfig:
    """A calibration's ranks are placed like a run's (CalibConfig.validate builds this very config)."""
    return RunConfig(nproc=nproc, backend=backend)


def _lab03(c):
    base = c()
    return [
        ("DDP runs", base),
        ("sweep at 2 ranks", c(nproc=2)),
        ("sweep at one rank per GPU (at least 2)", base),
        ("calibration", _cal(2)),
    ]


def _lab04(c):
    z3 = c(strategy="zero3", baseline_steps=0)
    return [("ZeRO-3 run", z3), ("DDP run", c(nproc=z3.nproc)), ("calibration", _cal(calibration_ranks(z3)))]


#: lab file stem prefix -> (title, parts(c) -> [(what, config)]), `c(**kw)` being that lab's `lab_config`.
LABS = {
    "00": ("setup check", lambda c: [("2-rank all-reduce", _cal(2))]),
    "01": ("DDP breakdown", lambda c: [("DDP run", c())]),
    "02": ("collectives, alpha-beta", lambda c: [("calibration", _cal(2))]),
    "03": ("buckets and GPU count", _lab03),
    "04": ("ZeRO-3 vs DDP", _lab04),
    "05": (
        "shrinking communication",
        lambda c: [("DDP runs with compression hooks", c()), ("calibration", _cal(calibration_ranks(c())))],
    ),
    "06": (
        "stragglers, parameter server, faults",
        lambda c: [("DDP and ps runs", c()), ("group-size calibration", _cal(3))],
    ),
    "07": (
        "beyond one machine",
        lambda c: [
            (
                "2 emulated nodes x 1 rank (gloo: the emulated link carries gloo's sockets)",
                c(nproc=1, backend="gloo", nnodes=2),
            ),
            ("calibration inside a node", _cal(2)),
        ],
    ),
    "08": (
        "build it yourself",
        lambda c: [
            ("exercises (2 ranks on CPU tensors, by design)", _cal(2).replace(device="cpu")),
            ("calibration", _cal(2, backend="gloo")),
        ],
    ),
    "10": (
        "tensor and pipeline parallelism",
        lambda c: [
            ("tensor-parallel runs (2 ranks)", c(nproc=2, strategy="tp", baseline_steps=0)),
            ("pipeline runs (2 stages)", c(nproc=2, strategy="pp", baseline_steps=0)),
            ("calibration", _cal(2)),
        ],
    ),
}
LABS["11"] = ("reading a profiler trace", lambda c: [("DDP run recorded with the profiler", c(profile=True))])
LABS["12"] = (
    "what does it cost?",
    lambda c: [
        ("DDP run with held-out evaluations", c()),
        ("crashed and interrupted runs (checkpoints, restarts)", c(checkpoint_every=2, max_restarts=4)),
        ("calibration", _cal(calibration_ranks(c()))),
    ],
)
LABS["09"] = (
    "does it still learn?",
    lambda c: [
        ("DDP, local SGD and PowerSGD runs", c()),
        (
            "asynchronous server and its workers (one more rank)",
            c(strategy="async", nproc=c().nproc + 1, baseline_steps=0),
        ),
        ("calibration", _cal(calibration_ranks(c()))),
    ],
)


def lab_parts(lab: str, ngpu: int, nccl=None, quick: bool = False) -> list[dict]:
    """Where each run of lab `lab` ("04" or "04_zero3_vs_ddp") places its ranks on a machine with `ngpu` GPUs
    and this NCCL: [{what, label, note, timing, nproc, nnodes, backend, device, ranks_per_gpu}] (label "cannot
    run as configured: ..." and nothing else when refused). Emulated nodes (nnodes > 1) all run on this machine,
    each node's local rank 0 on the same device."""
    key = lab[:2]
    if key not in LABS:
        raise ValueError(f"lab must be one of {', '.join(LABS)} (a lab notebook's number), got {lab!r}")
    out = []
    for what, cfg in LABS[key][1](lambda **kw: config_for(ngpu, quick, **kw)):
        try:
            p = cfg.placement(ngpu, nccl)
            out.append(
                {
                    "what": what,
                    "label": p.label,
                    "note": p.note,
                    "timing": p.timing,
                    "nproc": cfg.nproc,
                    "nnodes": cfg.nnodes,
                    "backend": p.backend,
                    "device": p.device,
                    "ranks_per_gpu": p.ranks_per_gpu,
                }
            )
        except ValueError as e:
            out.append({"what": what, "label": f"cannot run as configured: {e}", "note": "", "timing": ""})
    return out


def machine_banner(cfg: RunConfig | None = None) -> str:
    """What this machine offers and where a lab's ranks will run (GPUs or CPU, which backend, what that
    means for the numbers, how times are taken), so every lab states it before it measures anything."""
    cfg = cfg or lab_config()
    rec = recorded_machine()
    if rec is not None:
        return (
            f"grading from recorded runs ({replay_root()}): recorded on {rec['gpus']} CUDA GPU(s), "
            f"{'quick' if rec['quick'] else 'full'} mode; nothing is run again."
        )
    placed = cfg.placement()
    ngpu = device_count()
    head = f"{ngpu} CUDA GPU(s)" if ngpu else f"no GPU, {os.cpu_count()} CPU cores"
    return f"{head}: {placed.label}; timed with {placed.timing}." + (f" Note: {placed.note}." if placed.note else "")
