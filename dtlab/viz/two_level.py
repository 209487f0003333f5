"""Beyond one machine in the explorer: GPUs per node, an inter-node link, and the flat ring beside the
hierarchical all-reduce (:mod:`dtlab.model.hierarchy`), for one all-reduce across message sizes and for a
whole DDP step (:func:`dtlab.model.whatif.whatif` with the two-level price of every bucket).

`two_level_explorer(levels=..., compute=..., param_nbytes=...)` returns an ipywidgets box: sliders for nodes,
GPUs per node, network links per node, the intra- and inter-node alpha and bandwidth, and the bucket size;
one figure, shown again whole on every move. Where each alpha and beta comes from (a calibration per level, or an
assumed value) is stated above the sliders. The pure parts (:func:`levels_table`, :func:`two_level_figure`) are
testable without a kernel.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.model import hierarchy as hi
from dtlab.model import whatif as wi
from dtlab.model.link import Link, TwoLevelLink
from dtlab.viz.controls import bucket_count, bucket_slider_range, clip_to_range
from dtlab.viz.explorer_state import DEFAULT_COMPUTE, DEFAULT_COMPUTE_SOURCE
from dtlab.viz.figures import COLORS
from dtlab.viz.livefigure import FigureBox, LiveFigure
from dtlab.viz.loggrid import on_log_grid

#: Assumed levels when none are measured: NVLink-class inside a node, 100 Gbit/s-class between nodes.
ASSUMED_LEVELS = {
    "alpha_intra": 5e-6,
    "beta_intra": 1 / 100e9,
    "alpha_inter": 30e-6,
    "beta_inter": 1 / 12.5e9,
    "source": "assumed, not calibrated: NVLink-class inside a node, 100 Gbit/s-class between nodes",
}
SIZES = np.logspace(10, 31, 64, base=2.0)  # 1 KiB .. 2 GiB
ALG_COLORS = {"flat": COLORS["T_comm"], "hierarchical": COLORS["T_comp"]}
BW_TOP = 3  # the bandwidth sliders' top: 10**3 GB/s


def _check(levels) -> dict:
    """The levels as a dict (alpha_intra, beta_intra, alpha_inter, beta_inter: s, s/B; source), checked: given as
    a dict, or as a TwoLevelLink (dtlab.model.link), whose GPUs and network links per node come with it."""
    if isinstance(levels, TwoLevelLink):
        return _from_link(levels)
    if not isinstance(levels, dict):
        raise ValueError(
            f"levels must be a TwoLevelLink (dtlab.model.link) or a dict of alpha_intra, beta_intra, alpha_inter "
            f"and beta_inter, got {type(levels).__name__}"
        )
    out = dict(levels)
    for k in ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter"):
        v = out.get(k)
        if v is None or not np.isfinite(v) or v < 0:
            raise ValueError(f"levels[{k!r}] must be a finite number >= 0 (alpha in s, beta in s/B), got {v!r}")
    out.setdefault("source", "given by the caller")
    return out


def _from_link(link: TwoLevelLink) -> dict:
    """A TwoLevelLink's levels as the explorer's dict: each Link's one-line alpha and beta (a Link's size regimes
    are not used here, and the source says so; nor are its contention and stretch, which price compute beside the
    collectives), its GPUs and network links per node."""
    kept = [
        f"{name}: {lk.source}" + ("; its size regimes not used here (one line)" if lk.regimes else "")
        for name, lk in (("intra", link.intra), ("inter", link.inter))
    ]
    return {
        "alpha_intra": link.intra.alpha,
        "beta_intra": link.intra.beta,
        "alpha_inter": link.inter.alpha,
        "beta_inter": link.inter.beta,
        "source": "; ".join(kept),
        "gpus_per_node": link.gpus_per_node,
        "nics_per_node": link.nics_per_node,
    }


def levels_table(
    levels: dict,
    nodes: int,
    gpus_per_node: int,
    nics_per_node: int = 1,
    compute=None,
    param_nbytes=None,
    bucket_mb: float = 25.0,
) -> pd.DataFrame:
    """Flat vs hierarchical at one setting: one row per algorithm with the predicted DDP step (t_step, t_comm,
    exposed, t_comp in seconds, n_buckets) for `compute` (per-rank seconds t_fwd, t_bwd_comp, t_opt) and
    gradient sizes `param_nbytes` (ready order), and the network bytes per node per step (B)."""
    compute = compute or default_compute()
    sizes = list(param_nbytes) if param_nbytes is not None else wi.distilbert_param_nbytes()[::-1]
    rows = []
    for alg in hi.ALGORITHMS:
        link = levels_link(levels, gpus_per_node, nics_per_node, alg)
        r = wi.whatif(
            compute["t_fwd"], compute["t_bwd_comp"], compute["t_opt"], sizes, bucket_mb, nodes * gpus_per_node, link
        )
        rows.append(
            {
                "algorithm": alg,
                "t_step": r["t_step"],
                "t_comm": r["t_comm"],
                "exposed": r["exposed"],
                "t_comp": r["t_comp"],
                "n_buckets": r["n_buckets"],
                "network_bytes_per_node": float(
                    np.sum(hi.network_bytes_per_node(alg, np.asarray(r["bucket_nbytes"], float), nodes, gpus_per_node))
                ),
            }
        )
    return pd.DataFrame(rows)


def levels_link(levels: dict, gpus_per_node: int, nics_per_node: int = 1, algorithm: str = "hierarchical"):
    """The levels (alpha_intra, beta_intra, alpha_inter, beta_inter: s, s/B) as one TwoLevelLink of nodes of
    `gpus_per_node` ranks with `nics_per_node` network links, priced by `algorithm`."""
    lv = _check(levels)
    return TwoLevelLink(
        intra=Link(alpha=lv["alpha_intra"], beta=lv["beta_intra"], source="intra-node level"),
        inter=Link(alpha=lv["alpha_inter"], beta=lv["beta_inter"], source="inter-node level"),
        gpus_per_node=gpus_per_node,
        algorithm=algorithm,
        nics_per_node=nics_per_node,
    )


def default_compute() -> dict:
    """The explorer's placeholder compute (not measured), with its `source` saying so
    (:mod:`dtlab.viz.explorer_state`)."""
    return dict(DEFAULT_COMPUTE, source=DEFAULT_COMPUTE_SOURCE)


def two_level_figure(
    levels: dict, nodes: int, gpus_per_node: int, nics_per_node: int = 1, table: pd.DataFrame | None = None
) -> go.Figure:
    """Left: one all-reduce's predicted time (ms) against message size (MiB, log-log) for the flat ring and
    the hierarchical all-reduce, with the crossover size marked when there is one. Right (when `table` from
    :func:`levels_table` is given): the predicted DDP step per algorithm, compute + exposed communication."""
    lv = _check(levels)
    args = (lv["alpha_intra"], lv["beta_intra"], lv["alpha_inter"], lv["beta_inter"])
    fig = make_subplots(
        rows=1,
        cols=2 if table is not None else 1,
        column_widths=[0.62, 0.38] if table is not None else None,
        subplot_titles=("one all-reduce", "one DDP step") if table is not None else None,
    )
    for alg in hi.ALGORITHMS:
        t = hi.two_level_time(alg, *args, SIZES, nodes, gpus_per_node, nics_per_node)
        fig.add_trace(
            go.Scatter(
                x=SIZES / 2**20,
                y=t * 1e3,
                mode="lines",
                name=f"{alg} (predicted)",
                line=dict(color=ALG_COLORS[alg]),
                hovertemplate=f"{alg}<br>%{{x:.3g}} MiB: %{{y:.3g}} ms<extra></extra>",
            ),
            1,
            1,
        )
    x = hi.crossover_bytes(levels_link(lv, gpus_per_node, nics_per_node), nodes, lo=SIZES[0], hi=SIZES[-1])
    if x is not None:  # the label sits inside the plot, at its foot: above it is the subplot's title
        fig.add_vline(x=x / 2**20, line=dict(color="#555", dash="dot"), row=1, col=1)
        fig.add_annotation(
            x=np.log10(x / 2**20),
            y=0.02,
            yref="y domain",
            text=f"crossover {x / 2**20:.3g} MiB",
            showarrow=False,
            xanchor="left",
            yanchor="bottom",
            xshift=4,
            font=dict(size=11),
            bgcolor="rgba(255,255,255,0.8)",
            row=1,
            col=1,
        )
    fig.update_xaxes(type="log", title_text="message size (MiB)", row=1, col=1)
    fig.update_yaxes(type="log", title_text="predicted time (ms)", row=1, col=1)
    if table is not None:
        for name, col, color in (
            ("T_comp", "t_comp", COLORS["T_comp"]),
            ("exposed comm", "exposed", COLORS["exposed"]),
        ):
            fig.add_trace(
                go.Bar(
                    x=table["algorithm"],
                    y=table[col] * 1e3,
                    name=f"{name} (predicted)",
                    marker_color=color,
                    hovertemplate="%{x}: %{y:.2f} ms<extra></extra>",
                ),
                1,
                2,
            )
        fig.update_yaxes(title_text="ms per step", row=1, col=2)
        fig.update_layout(barmode="stack")
    p = nodes * gpus_per_node
    fig.update_layout(
        title=dict(
            text=f"Flat ring vs hierarchical: {nodes} node(s) x {gpus_per_node} GPU(s) = "
            f"p {p}, {nics_per_node} network link(s) per node",
            font_size=15,
        ),
        height=420,
        legend=dict(font_size=11),
    )
    return fig


def two_level_explorer(levels: dict | TwoLevelLink | None = None, compute=None, param_nbytes=None):
    """The two-level explorer widget (display it as a cell's last expression). levels: a TwoLevelLink
    (dtlab.model.link: e.g. `TwoLevelLink.from_node_counts` of two nccl-tests outputs; its GPUs and network links
    per node start the sliders), or a dict of alpha_intra, beta_intra, alpha_inter, beta_inter (s, s/B) and
    source; default :data:`ASSUMED_LEVELS`, labelled as assumed. compute / param_nbytes as for
    :func:`dtlab.viz.dashboard.explorer`.

    A log slider cannot show 0: an alpha of 0 (a fit clipped at zero) starts the slider at its lowest value,
    and the model keeps using 0 until the slider is moved (the label says so). The bucket slider spans only
    the sizes where these gradients' bucket count changes, and is hidden when it never does; with one node
    the network's controls (links, inter-node alpha and bandwidth) are hidden. The figure's
    state is stored after every redraw, so a reloaded page draws what the sliders show."""
    lv = _check(levels if levels is not None else ASSUMED_LEVELS)
    sizes = list(param_nbytes) if param_nbytes is not None else wi.distilbert_param_nbytes()[::-1]
    brange = bucket_slider_range(sizes, -7.0, 10.0, 0.05)
    s = _sliders(lv, brange)
    start = {k: w.value for k, w in s.items()}  # where each slider started: not moved while it shows this
    compute = compute or default_compute()
    label = widgets.HTML()

    def current():
        v = {k: w.value for k, w in s.items()}
        return _levels_now(lv, s, start, v), v

    def build():
        levels_now, v = current()
        table = levels_table(
            levels_now, v["nodes"], v["gpus_per_node"], v["nics_per_node"], compute, sizes, v["bucket_mb"]
        )
        label.value = _label_html(lv, s, compute, sizes, brange, levels_now, v)
        return two_level_figure(levels_now, v["nodes"], v["gpus_per_node"], v["nics_per_node"], table), table

    fig0, table0 = build()
    figw = LiveFigure(fig0)
    box = FigureBox([label, widgets.VBox(list(s.values())), figw])
    box.sliders, box.figure, box.table, box.levels = s, figw, table0, current

    def show_network_controls(change=None):  # one node has no network: its controls could change nothing
        for k in ("nics_per_node", "alpha_inter_us", "bw_inter_gbs"):
            s[k].layout.display = "none" if s["nodes"].value == 1 else None

    def redraw(change=None):
        fig, box.table = build()
        figw.show(fig)

    s["nodes"].observe(show_network_controls, names="value")
    for w in s.values():
        w.observe(redraw, names="value")
    box.redraw = redraw
    return box


def _sliders(lv: dict, brange) -> dict:
    """The explorer's sliders, by name, starting at the levels `lv` and a 25 MiB bucket (hidden when `brange`,
    the bucket sizes where the count changes, is None)."""
    style = {"description_width": "170px"}

    def layout():  # one per slider: hiding one control (display) must not hide the others
        return widgets.Layout(width="480px")

    def log(value, lo, hi_, desc, base=10, step=0.02):  # a value below the range (0) sits at its bottom
        value = max(value, float(base) ** lo)
        e = np.log(value) / np.log(base)
        return widgets.FloatLogSlider(
            value=value,
            base=base,
            min=min(lo, np.floor(e)),
            max=max(hi_, e),
            step=step,
            description=desc,
            style=style,
            layout=layout(),
            readout_format=".4g",
        )  # 1660, not 1.66e+3

    s = {
        "nodes": widgets.IntSlider(value=2, min=1, max=64, description="nodes", style=style, layout=layout()),
        "gpus_per_node": widgets.IntSlider(
            value=lv.get("gpus_per_node", 8), min=1, max=16, description="GPUs per node", style=style, layout=layout()
        ),
        "nics_per_node": widgets.IntSlider(
            value=lv.get("nics_per_node", 1),
            min=1,
            max=16,
            description="network links per node",
            style=style,
            layout=layout(),
        ),
        "alpha_intra_us": log(lv["alpha_intra"] * 1e6, -1, 4, "intra α (µs)"),
        "bw_intra_gbs": log(_gbs(lv["beta_intra"]), -2, BW_TOP, "intra 1/β (GB/s)"),
        "alpha_inter_us": log(lv["alpha_inter"] * 1e6, -1, 4, "inter α (µs)"),
        "bw_inter_gbs": log(_gbs(lv["beta_inter"]), -3, BW_TOP, "inter 1/β (GB/s)"),
        "bucket_mb": log(
            clip_to_range(25.0, brange), *(brange or (-7.0, 10.0)), "bucket size (MiB)", base=2, step=0.05
        ),
    }
    if brange is None:
        s["bucket_mb"].layout = widgets.Layout(width="480px", display="none")
    return s


def _gbs(beta: float) -> float:
    """A level's bandwidth (GB/s) for its slider: 1 / beta, or the slider's top (10**BW_TOP) for a beta of 0, which a
    log slider cannot show (free bytes: the label says the model keeps 0 until the slider moves)."""
    return 1 / beta / 1e9 if beta > 0 else 10.0**BW_TOP


def _levels_now(lv: dict, s: dict, start: dict, v: dict) -> dict:
    """The levels the model uses at slider values `v`: each one given in `lv` itself (not the slider's rounded
    copy of it) until the user moves its slider away from where it started."""

    def level(key, slider, to_model):
        w = s[slider]
        return lv[key] if on_log_grid(v[slider], start[slider], w.base, w.step) else to_model(v[slider])

    return {
        "alpha_intra": level("alpha_intra", "alpha_intra_us", lambda x: x * 1e-6),
        "beta_intra": level("beta_intra", "bw_intra_gbs", lambda x: 1 / (x * 1e9)),
        "alpha_inter": level("alpha_inter", "alpha_inter_us", lambda x: x * 1e-6),
        "beta_inter": level("beta_inter", "bw_inter_gbs", lambda x: 1 / (x * 1e9)),
        "source": lv["source"],
    }


def _label_html(lv: dict, s: dict, compute: dict, sizes: list, brange, levels_now: dict, v: dict) -> str:
    """The label above the sliders: where the levels and the compute come from, a zero alpha the slider cannot
    show, one node's hidden controls, and the bucket count."""
    lines = [f"<b>levels</b>: {html.escape(lv['source'])}; moving a slider overrides that value"]
    for key, name in (("alpha_intra", "intra α"), ("alpha_inter", "inter α")):
        if levels_now[key] == 0:
            lines.append(
                f"<b>{name} = 0 µs</b> in the model (the level given above); the slider's lowest value, "
                f"{s[key + '_us'].value:.3g} µs, stands for it until you move it"
            )
    for key, name, slider in (("beta_intra", "intra β", "bw_intra_gbs"), ("beta_inter", "inter β", "bw_inter_gbs")):
        if levels_now[key] == 0:
            lines.append(
                f"<b>{name} = 0</b> in the model (bytes cost nothing: the level given above); the slider's highest "
                f"value, {s[slider].value:.4g} GB/s, stands for it until you move it"
            )
    lines.append(
        f"<b>compute per rank</b>: fwd {compute['t_fwd'] * 1e3:.3g} ms, bwd "
        f"{compute['t_bwd_comp'] * 1e3:.3g} ms, opt {compute['t_opt'] * 1e3:.3g} ms "
        f"({html.escape(compute.get('source', 'given by the caller'))})"
    )
    if v["nodes"] == 1:
        lines.append(
            "<b>one node</b>: no network between nodes, so its controls (links, inter α and 1/β) "
            "are hidden until there are 2 nodes or more"
        )
    n = bucket_count(sizes, v["bucket_mb"])
    lines.append(
        f"<b>buckets</b>: {n} at {v['bucket_mb']:.3g} MiB"
        if brange is not None
        else f"<b>buckets</b>: {n} at every bucket size: no bucket control"
    )
    return "<div style='font-size:90%'>" + "<br>".join(lines) + "</div>"
