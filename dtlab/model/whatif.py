"""The pure "what if" DDP step model behind the explorer and lab 03: no run, no figure.

From gradient sizes, per-rank compute times and alpha-beta, predict one DDP step for any bucket size and
GPU count: DDP's bucket layout (:mod:`dtlab.model.buckets`), one all-reduce per bucket
(:mod:`dtlab.model.costmodel`), backward compute spread over the buckets by bytes, then the bucket queue
replayed. Also: DistilBERT's (and the tiny preset's) gradient sizes from the architecture alone, and the
compute times of a measured run. Pure numpy/pandas: no torch, no plotly, no ipywidgets; the figures are in
:mod:`dtlab.viz.model_plots`, the widgets in :mod:`dtlab.viz.dashboard`.

Units: seconds, bytes, seconds per byte (beta); bucket sizes in MiB (DDP's bucket_cap_mb).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtlab.config.models import TINY_ARCH  # a plain dict, the one dtlab.rank.data builds the tiny model from
from dtlab.model import buckets as bk
from dtlab.model.link import as_link
from dtlab.model.parallel import tp_allreduces
from dtlab.model.sharing import cpu_share_scale, stretched_backward
from dtlab.units import fmt_mib


def config_label(nproc, bucket_mb) -> str:
    """The x label of one configuration in the breakdown figure, e.g. 'p=4, 25 MiB'."""
    return f"p={int(nproc)}, {fmt_mib(bucket_mb)} MiB"


# ------------------------------------------------------------------ gradient sizes


def distilbert_param_nbytes(num_labels: int = 2) -> list[int]:
    """Gradient bytes (fp32, 4 per element) of every DistilBERT-base tensor, in registration order.

    Computed from the architecture alone (no torch): DistilBertConfig defaults -- vocabulary 30522,
    dim 768, 6 layers, FFN hidden 3072, 512 positions -- plus the sequence-classification head
    (pre_classifier 768x768, classifier 768 x num_labels). Order: embeddings (word, position,
    LayerNorm weight, bias), then per layer q_lin, k_lin, v_lin, out_lin (weight, bias each),
    sa_layer_norm, ffn lin1, ffn lin2, output_layer_norm, then pre_classifier and classifier.
    104 tensors, 66,955,010 parameters = 267,820,040 bytes for num_labels=2.

    DDP's gradients become ready in roughly the *reverse* of this order: pass ``[::-1]`` to
    :func:`whatif` / :func:`dtlab.model.buckets.bucket_layout`.
    """
    return [4 * int(np.prod(s)) for s in _distilbert_shapes(num_labels)]


#: The architectures of RunConfig.model, as DistilBertConfig fields: DistilBertConfig()'s defaults and
#: dtlab.rank.data's tiny preset (what the ranks build).
MODEL_ARCH = {
    "distilbert": dict(vocab_size=30522, dim=768, n_layers=6, hidden_dim=3072, max_position_embeddings=512),
    "tiny": {k: TINY_ARCH[k] for k in ("vocab_size", "dim", "n_layers", "hidden_dim", "max_position_embeddings")},
}


def model_param_nbytes(model: str, num_labels: int = 2) -> list[int]:
    """Gradient bytes of every tensor of a `RunConfig.model` ('distilbert' or 'tiny'), registration order,
    from the architecture alone (no torch). ``sum(...) // 4`` is the parameter count a run of that config
    reports as ``run.resolved["num_parameters"]``: labs print it instead of quoting DistilBERT's count."""
    return [4 * int(np.prod(s)) for s in model_param_shapes(model, num_labels)]


def model_param_shapes(model: str, num_labels: int = 2) -> list[tuple[int, ...]]:
    """The shape of every trainable tensor of a `RunConfig.model`, registration order, from the architecture
    alone (no torch): what PowerSGD's wire size depends on (:func:`dtlab.model.compression.powersgd_wire_numel`)."""
    if model not in MODEL_ARCH:
        raise ValueError(f"model must be one of {sorted(MODEL_ARCH)}, got {model!r}")
    a = MODEL_ARCH[model]
    return _distilbert_shapes(
        num_labels, a["vocab_size"], a["dim"], a["n_layers"], a["hidden_dim"], a["max_position_embeddings"]
    )


def _distilbert_shapes(num_labels=2, vocab=30522, dim=768, layers=6, hidden=3072, positions=512) -> list[tuple]:
    if int(num_labels) < 1:
        raise ValueError(f"num_labels must be an integer >= 1, got {num_labels!r}")

    def linear(n_in, n_out):  # torch.nn.Linear registers weight (out x in) then bias (out)
        return [(n_out, n_in), (n_out,)]

    def layer_norm(d):
        return [(d,), (d,)]

    shapes = [(vocab, dim), (positions, dim)] + layer_norm(dim)
    for _ in range(layers):
        for _lin in ("q_lin", "k_lin", "v_lin", "out_lin"):
            shapes += linear(dim, dim)
        shapes += layer_norm(dim)  # sa_layer_norm
        shapes += linear(dim, hidden)  # ffn.lin1
        shapes += linear(hidden, dim)  # ffn.lin2
        shapes += layer_norm(dim)  # output_layer_norm
    shapes += linear(dim, dim) + linear(dim, int(num_labels))  # pre_classifier, classifier
    return shapes


# ------------------------------------------------------------------ the step model


def _tp_replica(tp: dict, link, t_fwd, t_bwd_comp, t_opt, sizes: list, gpus: int) -> tuple:
    """Tensor parallelism of degree t inside each replica: per-rank compute, optimizer and gradients / t and the
    TP all-reduces on the compute path, half in forward, half in backward. (t_fwd, t_bwd_comp, t_opt, sizes,
    replicas, t, tp_comm)."""
    tp_degree = int(tp["degree"])
    tp_comm = float(tp["allreduces"]) * float(link.time("all_reduce", tp["allreduce_bytes"], tp_degree))
    t_fwd = float(t_fwd) / tp_degree + tp_comm / 2
    t_bwd_comp = float(t_bwd_comp) / tp_degree + tp_comm / 2
    t_opt = float(t_opt) / tp_degree
    sizes = [int(round(s / tp_degree)) for s in sizes]
    return t_fwd, t_bwd_comp, t_opt, sizes, max(1, gpus // tp_degree), tp_degree, tp_comm


def _priced_buckets(sizes: list, bucket_mb, ratio, link, nproc) -> tuple:
    """DDP's buckets for a cap of `bucket_mb` MiB and each one's idle all-reduce seconds on `link` for `ratio` x its
    bytes on the wire: (layout, bucket bytes, durations)."""
    if not sizes or sum(sizes) <= 0:
        raise ValueError("param_nbytes_in_ready_order must list gradient sizes (bytes) with a positive total")
    cap = bk.mb_to_bytes(bucket_mb)
    layout = bk.bucket_layout(sizes, cap, first_bucket_cap_bytes=cap)  # DDP given bucket_cap_mb: no small first bucket
    nbytes = bk.bucket_sizes(sizes, layout)
    wire = ratio * np.asarray(nbytes, dtype=float)
    durations = np.asarray(link.time("all_reduce", wire, nproc), dtype=float)
    return layout, nbytes, np.atleast_1d(durations)


def whatif(
    t_fwd,
    t_bwd_comp,
    t_opt,
    param_nbytes_in_ready_order,
    bucket_mb,
    nproc,
    link,
    ratio: float = 1.0,
    encode_s_per_byte: float = 0.0,
    tp: dict | None = None,
    cpu: dict | None = None,
    ready_curve=None,
    wait: float = 0.0,
) -> dict:
    """Predict one DDP step for a bucket size and GPU count from compute times and a link.

    The step model behind :func:`dtlab.results.whatif.whatif` (``run.whatif``: a measured run's inputs gathered for
    you), the explorer and dtlab.cost. t_fwd, t_bwd_comp, t_opt: forward, backward compute and optimizer seconds
    *per rank*, assumed independent of nproc: weak scaling, a fixed per-rank batch. param_nbytes_in_ready_order:
    gradient bytes in the order they become ready (reverse registration order for DDP). bucket_mb: DDP's
    bucket_cap_mb (MiB). link: a :class:`dtlab.model.link.Link` (alpha s, beta s/B, form, contention, stretch) or
    :class:`dtlab.model.link.TwoLevelLink` (nodes of gpus_per_node ranks): it prices each bucket's all-reduce idle
    (``link.time``); a bucket in flight before backward ends is priced `link.contention` times that
    (:func:`dtlab.model.buckets.simulate_queue`); backward loses `link.stretch` seconds per second of communication
    in service beside it, solved for its own length (:func:`dtlab.model.sharing.stretched_backward`; `stretch_s` in
    the result is what it added).
    ratio: compression r, bytes on the wire / gradient bytes (1: none; 0.5: fp16): the bandwidth term shrinks by r,
    the latency term does not. encode_s_per_byte: the hook's encode/decode seconds per gradient byte, added to
    backward compute. Both from :func:`dtlab.model.compression.compression_from_run` for a measured hook.
    tp: tensor parallelism inside each replica, {"degree": t, "allreduces": 4 L, "allreduce_bytes": b s h x 4}
    (:func:`tp_setting`): nproc // t replicas of t; compute, optimizer and gradients per rank shrink by t (an
    estimate: the split is taken as even), and the 4 L all-reduces over t ranks sit on the compute path (half in
    forward, half in backward): `tp_comm` in the result.
    cpu: where the ranks share one machine's CPU cores, how the compute was measured (:func:`compute_from_run`'s
    ``cpu``): compute scaled by :func:`dtlab.model.sharing.cpu_share_scale` for `nproc` ranks. None: independent.
    ready_curve: (byte fractions, time fractions) of a measured run (:func:`compute_from_run`'s ``ready_curve``);
    None: backward spread over the buckets in proportion to their bytes.
    wait: seconds the last all-reduce of a step takes beyond its price (:func:`measured_wait`), added to the last
    bucket when there is communication.

    Returns predict_step's dict (seconds: t_comm, t_comm_end, exposed, t_step, t_comp, overlap, start, end) plus
    n_buckets, bucket_nbytes (bytes), ready, durations and stretch_s (s), and the inputs (t_fwd, t_bwd_comp, t_opt,
    bucket_mb, nproc, link, form, contention, ratio). With nproc = 1 every duration is 0: no communication.
    """
    link = as_link(link)
    sizes = list(param_nbytes_in_ready_order)
    gpus = int(nproc)
    share = cpu_share_scale(gpus, cpu)
    t_fwd, t_bwd_comp, t_opt = float(t_fwd) * share, float(t_bwd_comp) * share, float(t_opt) * share
    tp_degree, tp_comm = 1, 0.0
    if tp is not None and int(tp["degree"]) > 1:
        t_fwd, t_bwd_comp, t_opt, sizes, nproc, tp_degree, tp_comm = _tp_replica(
            tp, link, t_fwd, t_bwd_comp, t_opt, sizes, gpus
        )
    _check_levers(ratio, encode_s_per_byte, wait)
    t_bwd_comp = float(t_bwd_comp) + encode_s_per_byte * sum(sizes)
    layout, nbytes, durations = _priced_buckets(sizes, bucket_mb, ratio, link, nproc)
    if int(nproc) > 1 and durations.size:
        durations = np.concatenate([durations[:-1], durations[-1:] + float(wait)])
    loaded = None if link.contention == 1 else link.contention * durations
    ready = bk.whatif_ready_times(t_fwd, t_bwd_comp, nbytes, ready_curve)
    stretch = link.stretch if int(nproc) > 1 else 0.0
    t_bwd, ready = stretched_backward(t_fwd, t_bwd_comp, ready, durations, loaded, stretch)
    out = bk.predict_step(t_fwd, t_bwd, t_opt, ready, durations, loaded=loaded)
    out.update(n_buckets=len(layout), bucket_nbytes=nbytes, ready=ready, durations=durations)
    out.update(t_fwd=t_fwd, t_bwd_comp=t_bwd_comp, t_opt=t_opt, bucket_mb=float(bucket_mb), nproc=gpus, link=link)
    out.update(form=link.form, ratio=float(ratio), encode_s_per_byte=float(encode_s_per_byte))
    out.update(tp_degree=tp_degree, tp_comm=tp_comm, dp=int(nproc), contention=link.contention, cpu_share=share)
    return dict(out, wait=float(wait) if int(nproc) > 1 else 0.0, stretch_s=t_bwd - t_bwd_comp)


def _check_levers(ratio, encode_s_per_byte, wait) -> None:
    if not np.isfinite(ratio) or not 0 < ratio <= 1:
        raise ValueError(f"ratio (bytes on the wire / gradient bytes) must be in (0, 1], got {ratio!r}")
    if not np.isfinite(encode_s_per_byte) or encode_s_per_byte < 0:
        raise ValueError(f"encode_s_per_byte must be a finite number >= 0 (s/B), got {encode_s_per_byte!r}")
    if not np.isfinite(wait) or wait < 0:
        raise ValueError(f"wait must be a finite number >= 0 (seconds), got {wait!r}")


def tp_setting(degree: int, n_layers: int, tokens: int, hidden: int, itemsize: int = 4) -> dict:
    """:func:`whatif`'s `tp`: Megatron tensor parallelism of degree t, 4 all-reduces per block and step of
    tokens x hidden x itemsize bytes (tokens = batch x sequence length per rank)."""
    return {
        "degree": int(degree),
        "allreduces": tp_allreduces(n_layers),
        "allreduce_bytes": int(tokens) * int(hidden) * int(itemsize),
    }


def whatif_sweep(
    t_fwd, t_bwd_comp, t_opt, param_nbytes_in_ready_order, configs, link, ratio: float = 1.0, **kw
) -> pd.DataFrame:
    """Run :func:`whatif` for each (nproc, bucket_mb) in `configs` on `link`; one row per configuration. `kw`:
    whatif's encode_s_per_byte, tp, cpu, ready_curve and wait.

    Same units and assumptions as :func:`whatif`. Columns: label (:func:`config_label`), nproc, bucket_mb (MiB),
    n_buckets, t_comp, t_comm, exposed, t_step (seconds) and overlap (fraction; NaN without communication). Ready
    for :func:`dtlab.viz.model_plots.predicted_breakdown_figure`.
    """
    sizes, figures = param_nbytes_in_ready_order, ["n_buckets", "t_comp", "t_comm", "exposed", "t_step", "overlap"]
    rows = []
    for nproc, bucket_mb in configs:
        r = whatif(t_fwd, t_bwd_comp, t_opt, sizes, bucket_mb, nproc, link, ratio, **kw)
        rows.append([config_label(nproc, bucket_mb), int(nproc), float(bucket_mb), *(r[k] for k in figures)])
    return pd.DataFrame(rows, columns=["label", "nproc", "bucket_mb", *figures])


def measured_wait(run, link, compute: dict | None = None) -> dict:
    """What a measured DDP run's exposed communication holds beyond the what-if's queue: :func:`whatif`'s `wait`.

    Measured: the median over the run's paired steps of (training step - the no-op hook step run right after it),
    slowest rank of each: its exposed communication, with the machine's drift cancelled pair by pair. Predicted:
    :func:`whatif`'s exposed at the run's own cap and rank count, from `compute` (default :func:`compute_from_run`
    of the run, with its readiness curve) and `link` (a Link or Profile; its stretch taken out of the measured
    exposed time, its contention in the queue's prices). wait = max(0, measured -
    predicted), in seconds: what the queue of idle-priced collectives does not reproduce (ranks out of step waiting
    for each other at the last all-reduce, collectives slowed by the cores they share). Returns wait, measured_exposed,
    predicted_exposed (s), pairs (how many) and source; wait 0 with the reason when the run has no paired steps."""
    b = run.baseline_steps
    if b is None or b.empty or "paired_step" not in b.columns or b["paired_step"].isna().all():
        return {"wait": 0.0, "pairs": 0, "source": f"none: {run.path} has no paired no-op hook steps"}
    ts = run.measured_steps().groupby("step")["t_step"].max()
    tb = b.dropna(subset=["paired_step"]).groupby("step").agg(t=("t_step", "max"), paired=("paired_step", "first"))
    diffs = [float(ts[int(p)]) - float(t) for t, p in zip(tb["t"], tb["paired"]) if int(p) in ts.index]
    if not diffs:
        return {"wait": 0.0, "pairs": 0, "source": f"none: no paired step of {run.path} is a measured step"}
    c = compute if compute is not None else compute_from_run(run)
    nproc = int(run.resolved.get("world_size") or run.nproc)
    sizes = list(reversed(run.resolved["param_nbytes"]))
    pred = whatif(
        c["t_fwd"],
        c["t_bwd_comp"],
        c["t_opt"],
        sizes,
        float(run.config.ddp.bucket_mb),
        nproc,
        as_link(link),
        ready_curve=c.get("ready_curve"),
    )
    measured = float(np.median(diffs))
    predicted = float(pred["exposed"] + pred["stretch_s"])  # a no-op hook step has no backward stretch either
    return {
        "wait": max(0.0, measured - predicted),
        "measured_exposed": measured,
        "predicted_exposed": predicted,
        "pairs": len(diffs),
        "source": f"measured: {run.path}, exposed communication of {len(diffs)} paired steps (median) less the "
        "what-if's at its own cap",
    }


def compute_from_run(run) -> dict:
    """Per-rank compute seconds (t_fwd, t_bwd_comp, t_opt) of a measured DDP run, for :func:`whatif`.

    With a no-op comm hook baseline (``run.baseline_steps``) the medians over baseline steps (slowest
    rank per step) are used: compute with no communication at all. Without one, backward compute is
    *estimated* from the measured steps as the time until the last bucket was ready. The dict's
    ``source`` says which. Also, for :func:`whatif`: ``cpu`` where the ranks shared a machine's CPU cores (cores,
    ranks there, threads per rank; other processes' load 0), and ``ready_curve`` where buckets were recorded
    (:func:`dtlab.model.buckets.ready_curve` of the slowest rank per measured step).
    """
    base = run.baseline_steps
    extra = {**_cpu_of(run), **_ready_of(run)}
    if base is not None and not base.empty:
        slow = base.loc[base.groupby("step")["t_step"].idxmax()]
        return {
            "t_fwd": float(slow["t_fwd"].median()),
            "t_bwd_comp": float(slow["t_bwd"].median()),
            "t_opt": float(slow["t_opt"].median()),
            "source": f"measured: no-op comm hook baseline of {run.path} ({len(slow)} steps, median)",
            **extra,
        }
    ps = run.measured_steps()
    if ps.empty:
        raise ValueError(f"run {run.path} has no measured steps to take compute times from")
    slow = ps.loc[ps.groupby("step")["t_step"].idxmax()]
    t_bwd = []
    for row in slow.itertuples():
        b = (
            run.buckets[(run.buckets["rank"] == row.rank) & (run.buckets["step"] == row.step)]
            if not run.buckets.empty
            else run.buckets
        )
        t_bwd.append(float(b["t_ready"].max()) - row.t_fwd if not b.empty else row.t_bwd)
    return {
        "t_fwd": float(slow["t_fwd"].median()),
        "t_bwd_comp": float(np.median(t_bwd)),
        "t_opt": float(slow["t_opt"].median()),
        "source": f"estimated from {run.path}: backward until the last bucket was ready (no baseline)",
        **extra,
    }


def _ready_of(run) -> dict:
    """{"ready_curve": (byte fractions, time fractions)} of the run's measured steps, slowest rank per step
    (:func:`dtlab.model.buckets.ready_curve`), for :func:`whatif`; {} without buckets to take it from."""
    b = getattr(run, "buckets", None)
    st = run.measured_steps()
    if b is None or b.empty or st.empty:
        return {}
    slow = st.loc[st.groupby("step")["t_step"].idxmax()]
    steps = []
    for row in slow.itertuples():
        mine = b[(b["rank"] == row.rank) & (b["step"] == row.step)].sort_values("bucket")
        steps.append((row.t_fwd, mine["t_ready"].to_numpy(), mine["nbytes"].to_numpy()))
    try:
        xs, ys = bk.ready_curve(steps)
    except ValueError:  # steps with different buckets (a rebuilt layout) or none ready after forward
        return {}
    return {"ready_curve": (xs.tolist(), ys.tolist())}


def _cpu_of(run) -> dict:
    """{"cpu": ...} for :func:`whatif` when the run's ranks shared a machine's CPU cores (device 'cpu'): its cores,
    the ranks on rank 0's host, torch threads per rank, other processes' load 0 (unknown here); {} otherwise."""
    res = getattr(run, "resolved", None) or {}
    if res.get("device_type") != "cpu" or not res.get("cpu_cores"):
        return {}
    ranks = getattr(run, "ranks", None)
    hosts = ranks.sort_values("rank")["host"] if ranks is not None and {"rank", "host"} <= set(ranks.columns) else []
    nproc = int((hosts == hosts.iloc[0]).sum()) if len(hosts) else int(res.get("ranks_per_node") or run.nproc)
    threads = int(res.get("torch_threads_per_rank") or 1)
    return {"cpu": {"cores": int(res["cpu_cores"]), "nproc": nproc, "threads_per_rank": threads, "other_cores": 0.0}}
