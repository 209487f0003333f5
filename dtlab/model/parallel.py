"""The forms beyond data parallelism, without a run: tensor parallelism's all-reduces, a pipeline's bubble and its
step, FSDP2's collectives, and the memory one GPU holds under a DP x TP x PP layout. Pure (numpy only).

Units: seconds, bytes, seconds per byte (beta), as in :mod:`dtlab.model.costmodel`.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, without sequence parallelism)
    per transformer block and step: 4 all-reduces over the t ranks of a replica (2 in forward, 2 in backward),
    each of the block's activations, b x s x h elements (b samples, s tokens, hidden h):
    T_tp = 4 L x T_allreduce(b s h x itemsize, t).
Pipeline (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019, the same bubble)
    bubble = (P - 1) / (M + P - 1); with equal stages, one micro-batch's forward + backward on one stage t_mb
    and a hand-off t_p2p each way, a step's schedule lasts (M + P - 1)(t_mb + 2 t_p2p).
FSDP2 / ZeRO-3 (Rajbhandari et al. 2020)
    per step: all-gather every unit's parameters in forward, every unit but the root again in backward,
    reduce-scatter every gradient.
Memory per GPU (fp32 training with AdamW, what dtlab's ranks run)
    16 bytes per parameter held (4 parameter, 4 gradient, 8 Adam state), the parameters of its stage split over
    t (sharded over d too with ZeRO-3 / FSDP2), plus activations: Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", section 4.1) give s b h (34 + 5 a s / h) bytes per layer with
    16-bit activations, s b h (10 + 24 / t + 5 a s / (h t)) under tensor parallelism without sequence parallelism
    (a heads); fp32 activations double the 2-byte terms, an estimate used here as x2. A stage holds M micro-batches'
    activations under GPipe, at most P under 1F1B.
"""

from __future__ import annotations

import numpy as np

from dtlab.model import costmodel

BYTES_PER_PARAM = 16  # fp32 parameter + gradient + AdamW's two moments
TP_ALLREDUCES_PER_BLOCK = 4
SCHEDULES = ("gpipe", "1f1b")


def tp_allreduce_bytes(batch: int, seq: int, hidden: int, itemsize: int = 4) -> int:
    """Bytes of one tensor-parallel all-reduce: the block's activations, b x s x h elements."""
    return int(batch) * int(seq) * int(hidden) * int(itemsize)


def tp_allreduces(n_layers: int) -> int:
    """All-reduces per step of a tensor-parallel replica: 4 per transformer block (2 forward, 2 backward)."""
    return TP_ALLREDUCES_PER_BLOCK * int(n_layers)


def tp_step_comm(link, batch: int, seq: int, hidden: int, n_layers: int, tp: int, itemsize: int = 4):
    """Seconds of tensor-parallel communication per step: 4 L all-reduces of b s h x itemsize bytes over tp ranks
    on `link` (a dtlab.model.link.Link; 0 for tp = 1)."""
    n = tp_allreduce_bytes(batch, seq, hidden, itemsize)
    return costmodel.scalar_or_array(tp_allreduces(n_layers) * np.asarray(link.time("all_reduce", n, tp), dtype=float))


def bubble_fraction(stages, microbatches):
    """(P - 1) / (M + P - 1): the fraction of a step each of P equal stages idles with M micro-batches."""
    p, m = np.asarray(stages, dtype=float), np.asarray(microbatches, dtype=float)
    if np.any(p < 1) or np.any(m < 1) or np.any(p != np.round(p)) or np.any(m != np.round(m)):
        raise ValueError(f"stages and microbatches must be integers >= 1, got {stages!r}, {microbatches!r}")
    return costmodel.scalar_or_array((p - 1) / (m + p - 1))


def pipeline_step(t_microbatch: float, stages: int, microbatches: int, t_p2p: float = 0.0) -> dict:
    """A pipeline step of equal stages: `t_microbatch` (s) one micro-batch's forward + backward on one stage,
    `t_p2p` (s) one hand-off of activations (or their gradient). Returns t_pipe = (M + P - 1)(t_mb + 2 t_p2p),
    busy = M t_mb (s per stage), p2p = 2 M t_p2p, bubble_s = (P - 1)(t_mb + 2 t_p2p), bubble (fraction)."""
    p, m = int(stages), int(microbatches)
    slot = float(t_microbatch) + (2 * float(t_p2p) if p > 1 else 0.0)
    t = (m + p - 1) * slot
    return {
        "t_pipe": t,
        "busy": m * float(t_microbatch),
        "p2p": m * (slot - float(t_microbatch)),
        "bubble_s": (p - 1) * slot,
        "bubble": float(bubble_fraction(p, m)),
    }


def in_flight(schedule: str, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations the first stage holds at once: M (GPipe) or min(M, P) (1F1B)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return int(microbatches) if schedule == "gpipe" else min(int(microbatches), int(stages))


def fsdp2_step_comm(link, param_bytes: float, root_bytes: float, nproc: int) -> dict:
    """Seconds of FSDP2's collectives per step on `link` (a dtlab.model.link.Link): all-gather of every parameter
    in forward, of every non-root unit's in backward, reduce-scatter of every gradient (full, padded sizes, bytes)."""
    ag_f = link.time("all_gather", param_bytes, nproc)
    ag_b = link.time("all_gather", param_bytes - root_bytes, nproc)
    rs = link.time("reduce_scatter", param_bytes, nproc)
    return {"all_gather_fwd": ag_f, "all_gather_bwd": ag_b, "reduce_scatter": rs, "total": ag_f + ag_b + rs}


def activation_bytes_per_layer(
    batch: float, seq: int, hidden: int, heads: int, tp: int = 1, itemsize: int = 4
) -> float:
    """Activations one transformer layer keeps for backward (bytes), Korthikanti et al. 2022 without sequence
    parallelism: s b h (10 + 24/t + 5 a s / (h t)) at 2 bytes per element, scaled by itemsize / 2."""
    s, b, h, a, t = float(seq), float(batch), float(hidden), float(heads), float(tp)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * (itemsize / 2)


def block_params(hidden: int, ffn: int) -> int:
    """Parameters of one DistilBERT/BERT block: q, k, v, out (h x h + h each), two LayerNorms, the feed-forward
    (h x f + f, f x h + h)."""
    h, f = int(hidden), int(ffn)
    return 4 * (h * h + h) + 4 * h + (h * f + f) + (f * h + h)


def layout_memory(
    arch: dict,
    batch_per_replica: int,
    seq: int,
    dp: int,
    tp: int,
    pp: int,
    microbatches: int = 1,
    schedule: str = "gpipe",
    sharded: bool = False,
) -> dict:
    """Bytes one GPU holds under a dp x tp x pp layout (the first stage, which also holds the embeddings: the
    largest). arch: vocab_size, dim, n_layers, n_heads, hidden_dim, max_position_embeddings. Parameters: the
    stage's blocks split over tp (embeddings and head replicated over tp, as dtlab's 'tp' keeps them), x16 bytes,
    over dp too when `sharded`; activations: `activation_bytes_per_layer` of one micro-batch x the stage's layers
    x `in_flight` (without a pipeline, M micro-batches are gradient accumulation: one micro-batch's activations at a
    time). Returns params, states (bytes of parameters, gradients, optimizer), activations, total."""
    h, L = int(arch["dim"]), int(arch["n_layers"])
    m = int(microbatches)
    layers = -(-L // int(pp))  # the largest stage
    emb = (int(arch["vocab_size"]) + int(arch["max_position_embeddings"])) * h + 2 * h
    head = (h * h + h) + (h * 2 + 2)
    stage = layers * block_params(h, int(arch["hidden_dim"])) / tp + emb + (head if pp == 1 else 0)
    states = stage * BYTES_PER_PARAM / (dp if sharded else 1)
    held = 1 if pp == 1 else in_flight(schedule, pp, m)  # one pipeline stage: gradient accumulation, one at a time
    act = activation_bytes_per_layer(float(batch_per_replica) / m, seq, h, int(arch["n_heads"]), tp) * layers * held
    return {"params": stage, "states": states, "activations": act, "total": states + act}
