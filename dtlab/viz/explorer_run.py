"""The explorer given a run: its inputs come from the run and every prediction is the run's own what-if
(:func:`dtlab.results.whatif.whatif`, ``run.whatif``), not assembled here from parts.

What the run gives: its compute (no-op hook steps), gradient sizes, readiness and, where the explorer's profile was
calibrated on the run's machine, its shared cores, load and measured wait (run.whatif decides which, and says so in
its lines). The controls give the link: the profile's own Link (its regimes, contention and stretch) while alpha,
beta, form and contention show what the profile fitted, a Link of the values shown once one is moved. Pure: no
widgets, no plotly.
"""

from __future__ import annotations

from dtlab.model import whatif as wi
from dtlab.model.link import Link
from dtlab.results.whatif import whatif, whatif_table


class RunInputs:
    """A measured DDP run and the explorer's profile, for :meth:`dtlab.viz.explorer_state.ExplorerState.model`.

    Attributes: run; compute (:func:`dtlab.model.whatif.compute_from_run`: per-rank seconds, source, readiness);
    sizes (gradient bytes in ready order); sizes_source (words); profile_link (the profile's all-reduce Link, or
    None without a profile); here (whether run.whatif takes the profile as measured on the run's machine);
    lines (run.whatif's inputs used and not used, at the run's own setting)."""

    def __init__(self, run, profile=None):
        run = getattr(run, "run", run)  # a RecordedRun holds its Run
        if not hasattr(run, "resolved") or not run.resolved.get("param_nbytes"):
            raise ValueError("run must be a measured DDP run (dtlab.run, dtlab.load_run) with its gradient sizes")
        self.run = run
        self.compute = wi.compute_from_run(run)
        self.sizes = list(reversed(run.resolved["param_nbytes"]))
        self.sizes_source = f"{len(self.sizes)} tensors of the run {run.path}, in the order they become ready"
        fits = getattr(profile, "fits", None) or {}
        self.profile_link = Link.from_profile(profile) if "all_reduce" in fits else None
        own = whatif(run, profile if self.profile_link is not None else Link(alpha=0.0, beta=0.0), nodes=1)
        self.here = bool(own.setting["here"])
        self.lines = [f"used: {u}" for u in own.used] + [f"not used: {u}" for u in own.not_used]

    def link(self, p: dict, unmoved: bool) -> Link:
        """The link of setting `p` (:meth:`ExplorerState.params`): the profile's own while `unmoved` (alpha, beta,
        form and contention as fitted), else the values shown, with the profile's stretch."""
        if unmoved and self.profile_link is not None:
            return self.profile_link
        stretch = self.profile_link.stretch if self.profile_link is not None else 0.0
        return Link(alpha=p["alpha"], beta=p["beta"], form=p["form"], contention=p["contention"], stretch=stretch)

    def model(self, link: Link, p: dict, configs) -> tuple[dict, object]:
        """(run.whatif's step model dict at setting `p`, :func:`dtlab.results.whatif.whatif_table` over `configs`),
        both on `link`, one node, compression r as set."""
        kw = dict(nodes=1, compression=float(p["ratio"]), here=self.here)
        now = whatif(self.run, link, nproc=int(p["nproc"]), bucket_mb=float(p["bucket_mb"]), **kw)
        return now.detail, whatif_table(self.run, link, configs, **kw)
