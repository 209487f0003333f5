"""The planner: for a model, a GPU count and a two-level interconnect, every DP x TP x PP layout with its memory
per GPU and predicted step time. Pure (numpy, pandas); the widget is :mod:`dtlab.viz.planner`.

Placement follows Megatron-LM's order (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters"): tensor-parallel ranks innermost (consecutive ranks, one node when t <= GPUs per node), then
pipeline stages, then data-parallel replicas. Each axis's communication is priced with the alpha-beta model of
the level it crosses (:mod:`dtlab.model.hierarchy`'s flat ring over the nodes a group spans):

- M micro-batches per step: a pipeline's, or gradient accumulation without one (activations of one at a time);
- TP: per micro-batch and stage, 4 all-reduces per layer of (b/M) s h x 4 bytes over t ranks, on the compute path;
- PP: one hand-off of (b/M) s h x 4 bytes each way per micro-batch and stage boundary, alpha + beta n at the level
  between neighbouring stages (another node once t x p exceeds a node); the step is (M + P - 1) slots
  (:func:`dtlab.model.parallel.pipeline_step`);
- DP: one all-reduce of the GPU's gradients over the d replicas after backward, not overlapped (an upper bound);
  sharded (ZeRO-3 / FSDP2): two all-gathers and a reduce-scatter, 1.5 x that all-reduce in the ring form.

Compute comes from a run (`compute`): forward + backward seconds per sample of the run's model on one rank and its
optimizer seconds, scaled to another model by 6 x non-embedding parameters x tokens (Kaplan et al. 2020's rule;
an estimate, and so labelled) and split over t x p ranks. Memory per GPU: :func:`dtlab.model.parallel.layout_memory`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtlab.model import hierarchy
from dtlab.model.parallel import block_params, layout_memory, pipeline_step, tp_allreduce_bytes, tp_allreduces

#: Architectures for the planner (DistilBertConfig-style fields); BERT-large and GPT-3's sizes (Brown et al.
#: 2020, table 2.1) for a sense of scale.
MODELS = {
    "tiny": dict(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=512),
    "distilbert": dict(vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072, max_position_embeddings=512),
    "bert-large": dict(
        vocab_size=30522, dim=1024, n_layers=24, n_heads=16, hidden_dim=4096, max_position_embeddings=512
    ),
    "gpt3-1.3b": dict(
        vocab_size=50257, dim=2048, n_layers=24, n_heads=16, hidden_dim=8192, max_position_embeddings=2048
    ),
    "gpt3-6.7b": dict(
        vocab_size=50257, dim=4096, n_layers=32, n_heads=32, hidden_dim=16384, max_position_embeddings=2048
    ),
    "gpt3-13b": dict(
        vocab_size=50257, dim=5120, n_layers=40, n_heads=40, hidden_dim=20480, max_position_embeddings=2048
    ),
    "gpt3-175b": dict(
        vocab_size=50257, dim=12288, n_layers=96, n_heads=96, hidden_dim=49152, max_position_embeddings=2048
    ),
}
COLUMNS = [
    "layout",
    "dp",
    "tp",
    "pp",
    "microbatches",
    "params_per_gpu",
    "memory",
    "fits",
    "t_step",
    "compute",
    "tp_comm",
    "p2p",
    "bubble",
    "dp_comm",
    "optimizer",
    "tp_level",
    "pp_level",
    "dp_level",
]


def nonembedding_params(arch: dict) -> int:
    """Parameters of the transformer blocks (what the 6 N tokens rule counts)."""
    return int(arch["n_layers"]) * block_params(int(arch["dim"]), int(arch["hidden_dim"]))


def total_params(arch: dict) -> int:
    """Every parameter, embeddings and a 2-label head included."""
    h = int(arch["dim"])
    return (
        nonembedding_params(arch)
        + (int(arch["vocab_size"]) + int(arch["max_position_embeddings"]) + 2) * h
        + h * h
        + h
        + 2 * h
        + 2
    )


def layouts(gpus: int, arch: dict) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp x tp x pp = gpus that the model can take: tp dividing the heads and the
    feed-forward width, pp at most the layers."""
    out = []
    for tp in range(1, gpus + 1):
        if gpus % tp or arch["n_heads"] % tp or arch["hidden_dim"] % tp:
            continue
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp or pp > arch["n_layers"]:
                continue
            out.append((gpus // (tp * pp), tp, pp))
    return out


def _ring(levels: dict, nbytes: float, members: int, per_node: int) -> tuple[float, str]:
    """A flat ring all-reduce over `members` ranks, `per_node` of them on each node (seconds, the level)."""
    if members <= 1:
        return 0.0, "-"
    per_node = max(1, min(per_node, members))
    nodes = -(-members // per_node)
    t = float(
        hierarchy.flat_ring_allreduce(
            levels["alpha_intra"],
            levels["beta_intra"],
            levels["alpha_inter"],
            levels["beta_inter"],
            nbytes,
            nodes,
            per_node,
        )
    )
    return t, "intra-node" if nodes == 1 else ("inter-node" if per_node == 1 else "both levels")


def predict_layout(
    arch: dict,
    dp: int,
    tp: int,
    pp: int,
    *,
    gpus_per_node: int,
    global_batch: int,
    seq: int,
    microbatches: int,
    schedule: str,
    sharded: bool,
    levels: dict,
    compute: dict,
) -> dict:
    """One layout's memory per GPU and predicted step (s), its parts and the level each axis crosses."""
    g = int(gpus_per_node)
    b = global_batch / dp
    m = int(microbatches)
    mem = layout_memory(arch, b, seq, dp, tp, pp, m, schedule, sharded)
    scale = (nonembedding_params(arch) * seq) / (compute["nonembedding_params"] * compute["seq"])
    t_mb = compute["t_fb_per_sample"] * scale * b / (tp * pp) / m
    act = tp_allreduce_bytes(b / m, seq, int(arch["dim"]))
    layers = -(-int(arch["n_layers"]) // pp)
    t_ar, tp_level = _ring(levels, act, tp, g)
    tp_mb = tp_allreduces(layers) * t_ar
    inter_pp = tp * pp > g
    t_p2p = (
        0.0
        if pp == 1
        else (
            levels["alpha_inter"] + levels["beta_inter"] * act
            if inter_pp
            else levels["alpha_intra"] + levels["beta_intra"] * act
        )
    )
    pipe = pipeline_step(t_mb + tp_mb, pp, m, t_p2p)
    grads = mem["params"] * 4
    t_dp, dp_level = _ring(levels, grads, dp, max(1, g // (tp * pp)))
    t_dp *= 1.5 if sharded else 1.0
    t_opt = compute["t_opt"] * mem["params"] / compute["params"] / (dp if sharded else 1)
    return {
        "layout": f"{dp}x{tp}x{pp}",
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "microbatches": m,
        "params_per_gpu": mem["params"],
        "memory": mem["total"],
        "t_step": pipe["t_pipe"] + t_dp + t_opt,
        "compute": m * t_mb,
        "tp_comm": m * tp_mb,
        "p2p": pipe["p2p"],
        "bubble": pipe["bubble_s"],
        "dp_comm": t_dp,
        "optimizer": t_opt,
        "tp_level": tp_level,
        "pp_level": "-" if pp == 1 else ("inter-node" if inter_pp else "intra-node"),
        "dp_level": dp_level,
    }


def plan(
    arch: dict,
    gpus: int,
    *,
    gpus_per_node: int,
    gpu_memory: float,
    global_batch: int,
    seq: int,
    microbatches: int = 4,
    schedule: str = "1f1b",
    sharded: bool = False,
    levels: dict,
    compute: dict,
) -> pd.DataFrame:
    """Every layout of `gpus` GPUs (:func:`layouts`) whose replicas split the global batch evenly, predicted
    (:func:`predict_layout`), with `fits` (memory per GPU <= gpu_memory bytes); fastest first, those that do not
    fit after those that do. Times in seconds, memory in bytes."""
    _check_levels(levels)
    rows = []
    for dp, tp, pp in layouts(int(gpus), arch):
        m = int(microbatches)
        if global_batch % dp or (global_batch // dp) % m:
            continue  # replicas of unequal batches, or micro-batches that do not divide one
        r = predict_layout(
            arch,
            dp,
            tp,
            pp,
            gpus_per_node=gpus_per_node,
            global_batch=global_batch,
            seq=seq,
            microbatches=microbatches,
            schedule=schedule,
            sharded=sharded,
            levels=levels,
            compute=compute,
        )
        r["fits"] = bool(r["memory"] <= gpu_memory)
        rows.append(r)
    df = pd.DataFrame(rows, columns=COLUMNS)
    if df.empty:
        return df
    return df.sort_values(["fits", "t_step"], ascending=[False, True], kind="stable").reset_index(drop=True)


def compute_from_run(run) -> dict:
    """The planner's compute from a measured run: forward + backward seconds per sample of the whole model on one
    rank, and the optimizer's seconds for all of it, with the run's model size; `source` says how.

    A data-parallel run with a no-op baseline ('ddp'): its baseline steps (slowest rank, median). A pipeline
    ('pp'): the sum over stages of every micro-batch's forward and backward (the whole model's compute, stage by
    stage) and of the stages' optimizer steps, median over measured steps."""
    arch = MODELS.get(run.config.model)
    if arch is None:
        raise ValueError(f"run {run.path}: model {run.config.model!r} has no architecture in the planner")
    bs, seq = int(run.config.batch_size), int(run.config.seq_len)
    out = {
        "seq": seq,
        "nonembedding_params": nonembedding_params(arch),
        "model": run.config.model,
        "params": int(run.resolved.get("num_parameters", total_params(arch))),
    }
    base = run.baseline_steps
    if base is not None and not base.empty:
        slow = base.loc[base.groupby("step")["t_step"].idxmax()]
        return {
            **out,
            "t_fb_per_sample": float((slow["t_fwd"] + slow["t_bwd"]).median()) / bs,
            "t_opt": float(slow["t_opt"].median()),
            "source": (
                f"measured: the no-op baseline of {run.path} ({run.config.model}, batch {bs} x "
                f"{seq} tokens per rank, median of {len(slow)} steps)"
            ),
        }
    mb = run.microbatches
    if mb is not None and not mb.empty:
        mb = mb[mb["step"] >= run.warmup]
        busy = (mb["t_end"] - mb["t_start"]).groupby(mb["step"]).sum()
        st = run.measured_steps()
        opt = st.groupby("step")["t_opt"].sum()
        return {
            **out,
            "t_fb_per_sample": float(busy.median()) / bs,
            "t_opt": float(opt.median()),
            "source": (
                f"measured: every stage's forwards and backwards of {run.path} summed ({run.config.model},"
                f" batch {bs} x {seq} tokens, median of {len(busy)} steps)"
            ),
        }
    raise ValueError(f"run {run.path} measured no compute alone: give a 'ddp' run with baseline_steps or a 'pp' run")


def measured_rows(runs: dict) -> pd.DataFrame:
    """Measured layouts for the planner's overlay: label -> run; one row per run with dp, tp, pp (from the run's
    layout) and t_step (s, the summary's median)."""
    rows = []
    for label, run in runs.items():
        lay = run.resolved.get("layout") or {"dp": run.nproc, "tp": 1, "pp": 1}
        t = float(run.summary().set_index("quantity").loc["T_step", "value"])
        rows.append(
            {
                "label": label,
                "dp": int(lay["dp"]),
                "tp": int(lay["tp"]),
                "pp": int(lay["pp"]),
                "layout": f"{lay['dp']}x{lay['tp']}x{lay['pp']}",
                "t_step": t,
                "microbatches": int(run.config.parallel.microbatches),
            }
        )
    return pd.DataFrame(rows, columns=["label", "dp", "tp", "pp", "layout", "t_step", "microbatches"])


def levels_from_profile(profile) -> dict:
    """One machine's calibration as both levels (this machine has one node: its loopback is the only link),
    labelled so."""
    a, b, how = hierarchy.level_from_profile(profile)
    return {
        "alpha_intra": a,
        "beta_intra": b,
        "alpha_inter": a,
        "beta_inter": b,
        "source": f"this machine's calibration for both levels ({how}; one node: no network measured)",
    }


def _check_levels(levels: dict) -> dict:
    for k in ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter"):
        v = levels.get(k)
        if v is None or not np.isfinite(v) or v < 0:
            raise ValueError(f"levels[{k!r}] must be a finite number >= 0 (alpha in s, beta in s/B), got {v!r}")
    return levels


def against_runs(runs: dict, levels: dict, compute: dict, gpus_per_node: int = 8) -> pd.DataFrame:
    """The planner's prediction for each measured run's own layout and setting beside its measured T_step (s):
    label, layout, microbatches, predicted, measured, error ((predicted - measured) / measured), and the compute
    part of each (s per GPU and step: the prediction's compute + optimizer, the run's T_comp = T_step - time
    blocked on its collectives, sends and receives)."""
    rows = []
    for label, run in runs.items():
        lay = run.resolved.get("layout") or {"dp": run.nproc, "tp": 1, "pp": 1}
        arch = MODELS[run.config.model]
        m = int(run.config.parallel.microbatches)
        p = predict_layout(
            arch,
            int(lay["dp"]),
            int(lay["tp"]),
            int(lay["pp"]),
            gpus_per_node=gpus_per_node,
            global_batch=int(run.config.batch_size) * int(lay["dp"]),
            seq=int(run.config.seq_len),
            microbatches=m,
            schedule=run.config.parallel.schedule,
            sharded=False,
            levels=levels,
            compute=compute,
        )
        s = run.summary().set_index("quantity")["value"]
        t = float(s["T_step"])
        rows.append(
            {
                "label": label,
                "layout": p["layout"],
                "microbatches": m,
                "predicted": p["t_step"],
                "measured": t,
                "error": p["t_step"] / t - 1,
                "predicted_compute": p["compute"] + p["optimizer"],
                "measured_compute": float(s["T_comp"]),
            }
        )
    return pd.DataFrame(rows)
