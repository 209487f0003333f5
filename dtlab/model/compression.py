"""The communication levers measured and modelled: compression (bytes on the wire), and communicating once per K
micro-batches (accumulation). Functions of recorded runs and pure formulas; nothing here launches anything.

- :func:`powersgd_wire_numel`: what torch's PowerSGD hook sends for a list of gradient shapes at rank r (the
  model's r, before any run);
- :func:`compression_from_run`: the measured ratio r = bytes on the wire / gradient bytes, and the encode time
  the hook cost per step, for the cost model and the explorer's compression slider;
- :func:`comm_per_sample`: T_comm and T_step per training sample, the quantity accumulation shrinks;
- :func:`loss_beside`: a run's loss curve beside a reference run that differs only in the lever (same seed).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

#: torch's PowerSGDState default: a matrix is compressed only when its rank-r factors are at least this many
#: times smaller than the matrix (``min_compression_rate``).
POWERSGD_MIN_COMPRESSION_RATE = 2.0


def powersgd_wire_numel(shapes, rank: int, min_compression_rate: float = POWERSGD_MIN_COMPRESSION_RATE) -> int:
    """Elements torch's ``powerSGD_hook`` puts on the wire per step for gradients of these shapes.

    Each gradient is viewed as an n x m matrix (n = first dimension, m = the product of the others). With
    r' = min(n, m, rank) it travels as P (n x r') and Q (m x r'), (n + m) r' elements, when that is at least
    `min_compression_rate` times smaller than n m; otherwise (biases, LayerNorm, small matrices) it is
    all-reduced whole, n m elements. Multiply by the element size (4 B for fp32) for bytes. Source: torch's
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` documentation (Vogels et al., 2019)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    total = 0
    for shape in shapes:
        shape = tuple(int(d) for d in shape)
        n = shape[0] if shape else 1
        m = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return int(total)


def _compressed_buckets(run) -> pd.DataFrame:
    """The measured steps' buckets of a run, with the steps where the hook really compressed (PowerSGD runs a
    plain all-reduce for its first start_iter steps: those are left out)."""
    b = run.buckets
    if b.empty or "wire_bytes" not in b.columns:
        raise ValueError(f"run {run.path} has no recorded buckets with wire_bytes (record=True, strategy ddp)")
    b = b[b["step"] >= run.warmup]
    per = b.groupby("step")[["nbytes", "wire_bytes"]].sum()
    hook = run.config.compression.hook
    if hook == "powersgd":
        keep = per.index[per["wire_bytes"] < per["nbytes"]]
        if len(keep) == 0:
            raise ValueError(
                f"run {run.path}: PowerSGD never compressed in the measured steps (all steps before "
                f"powersgd_start_iter = {run.config.compression.powersgd_start_iter}?)"
            )
        steps = sorted(int(st) for st in keep)
        # the first compressed step also builds PowerSGD's state (its P and Q matrices): its encode time is a
        # one-off, not the per-step cost the explorer prices, so it is left out when a later one exists
        b = b[b["step"].isin(steps[1:] if len(steps) > 1 else steps)]
    return b


def compression_from_run(run) -> dict:
    """The measured compression of a DDP run, for the cost model and the explorer's slider.

    Returns ratio (bytes on the wire / gradient bytes over the measured steps where the hook compressed; for
    PowerSGD without its first compressed step, which also builds its state, when a later one exists),
    wire_bytes and grad_bytes per rank-step (B), encode_s (median per rank-step of the summed encode time,
    t_start - t_ready of each bucket: the hook's work before its first collective, seconds; 0 without a hook),
    encode_s_per_byte (encode_s / gradient bytes, s/B), hook, and source (a sentence naming the run). The decode
    runs inside the collective's interval (t_end - t_start) and is not separated from it."""
    b = _compressed_buckets(run)
    per = b.groupby(["rank", "step"]).agg(nbytes=("nbytes", "sum"), wire_bytes=("wire_bytes", "sum"))
    enc = (b["t_start"] - b["t_ready"]).groupby([b["rank"], b["step"]]).sum()
    grad = float(per["nbytes"].median())
    wire = float(per["wire_bytes"].median())
    encode = float(enc.median()) if len(enc) else 0.0
    hook = run.config.compression.hook
    return {
        "ratio": wire / grad,
        "wire_bytes": wire,
        "grad_bytes": grad,
        "encode_s": encode,
        "encode_s_per_byte": encode / grad,
        "hook": hook,
        "source": f"measured: {hook} hook in {run.path} ({len(per)} rank-steps, median)",
    }


def samples_per_step(run) -> int:
    """Training samples one optimizer step consumes across all ranks: batch_size x accumulate x nproc."""
    c = run.config
    return int(c.batch_size) * int(c.ddp.accumulate) * run.nproc


def comm_per_sample(run) -> dict:
    """T_comm, T_step and T_comp per training sample (seconds per sample, medians of the run's summary) and the
    all-reduce rounds per micro-batch: what accumulation changes. Keys: accumulate, samples_per_step,
    t_step, t_comm, t_comp (s per step), t_step_per_sample, t_comm_per_sample, t_comp_per_sample
    (s per sample), rounds_per_micro_batch (bucket all-reduces per micro-batch on one rank)."""
    s = run.summary().set_index("quantity")["value"]
    k = int(run.config.ddp.accumulate)
    n = samples_per_step(run)
    b = run.buckets[run.buckets["step"] >= run.warmup]
    rounds = float(b.groupby(["rank", "step"]).size().median()) if not b.empty else float("nan")
    out = {"accumulate": k, "samples_per_step": n, "rounds_per_micro_batch": rounds / k}
    for q in ("t_step", "t_comm", "t_comp"):
        out[q] = float(s[q.replace("t_", "T_")])
        out[f"{q}_per_sample"] = out[q] / n
    return out


_SAME = ("model", "model_source", "data", "seed", "batch_size", "seq_len", "lr", "nproc")


def loss_beside(run, reference) -> pd.DataFrame:
    """The training loss of `run` beside `reference`, step by step (mean over ranks of each rank's local
    loss). Both runs must share model, data, seed, batch, sequence length, learning rate and rank count, so the
    only difference is the lever (compression hook, bucket size, ...): otherwise ValueError naming the fields.
    Columns: step, loss, loss_reference, diff (loss - loss_reference), rel_diff (diff / loss_reference)."""

    def field(r, f):  # the learning rate the run trained at (`lr` None in its config means the default it chose)
        return getattr(r, "lr", r.config.lr) if f == "lr" else getattr(r.config, f)

    differ = [f for f in _SAME if field(run, f) != field(reference, f)]
    if differ:
        raise ValueError(
            "the runs differ in "
            + ", ".join(f"{f} ({field(run, f)!r} vs {field(reference, f)!r})" for f in differ)
            + ": the loss comparison needs runs that differ only in the lever"
        )
    a = run.steps.groupby("step")["loss"].mean()
    r = reference.steps.groupby("step")["loss"].mean()
    df = pd.DataFrame({"loss": a, "loss_reference": r}).dropna().reset_index()
    df["diff"] = df["loss"] - df["loss_reference"]
    df["rel_diff"] = df["diff"] / df["loss_reference"].abs()
    return df


def lever_table(runs: dict) -> pd.DataFrame:
    """One row per run (label -> Run): the lever (comm_hook, accumulate), gradient and wire bytes per
    rank-step (B), r, the encode time (s per step) and the step breakdown per step and per sample (s). Every
    number comes from the run's records (:func:`compression_from_run`, :func:`comm_per_sample`)."""
    rows = []
    for label, run in runs.items():
        comp = compression_from_run(run)
        per = comm_per_sample(run)
        rows.append(
            {
                "label": label,
                "comm_hook": comp["hook"],
                "accumulate": per["accumulate"],
                "grad_bytes": comp["grad_bytes"],
                "wire_bytes": comp["wire_bytes"],
                "ratio": comp["ratio"],
                "encode_s": comp["encode_s"],
                "t_step": per["t_step"],
                "t_comp": per["t_comp"],
                "t_comm": per["t_comm"],
                "t_comm_per_sample": per["t_comm_per_sample"],
                "t_step_per_sample": per["t_step_per_sample"],
                "rounds_per_micro_batch": per["rounds_per_micro_batch"],
            }
        )
    return pd.DataFrame(rows)
