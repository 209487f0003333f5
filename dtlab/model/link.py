"""A link is one value: the alpha-beta price of a collective, and where it was measured what sharing the machine
costs (contention, stretch), for the what-if step (dtlab.model.whatif) and everything built on it.

- :class:`Link`: one level. alpha (s), beta (s/B), form ('ring': the bandwidth-optimal ring, 2(p-1) alpha +
  2(p-1)/p n beta for an all-reduce; 'textbook': the course's alpha(p-1) + beta n/p), their intervals where fitted,
  contention (loaded / idle all-reduce time while backward runs beside it, >= 1) and stretch (backward seconds lost
  per second of communication in flight, >= 0). Made by hand, or from a calibrated Profile, whatever its source
  (:meth:`Link.from_profile`). From a Profile fitted piecewise it keeps the size regimes (:class:`Regime`): NCCL
  switches protocol and algorithm with message size, and one line fitted over every size misses the middle sizes
  (on the AWS p5 outputs shipped with dtlab, by 20-43 % at 1-32 MiB), so each size is priced by its own regime.
- :class:`TwoLevelLink`: nodes of `gpus_per_node` ranks, an intra-node Link and an inter-node Link, priced flat or
  hierarchically (dtlab.model.hierarchy).

Both price a collective with ``link.time(op, nbytes, nproc)`` (seconds; bytes are the full message, the nccl-tests
convention) and give the low and high ends of their band with ``link.bounds()``. Pure: numpy only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from dtlab.model import costmodel
from dtlab.model import hierarchy as hi
from dtlab.model.sharing import contention_from_profile, stretch_from_profile
from dtlab.units import fmt_bytes

#: Message size (bytes) at which a profile's loaded / idle all-reduce ratio is read: DDP's default bucket cap.
CONTENTION_AT_BYTES = 25 * 2**20


def _number(name: str, value, what: str, minimum: float | None = None, above: float | None = None) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    v = float(value) if ok else math.nan
    bad = not math.isfinite(v) or (minimum is not None and v < minimum) or (above is not None and v <= above)
    if bad:
        limit = f" >= {minimum:g}" if minimum is not None else (f" > {above:g}" if above is not None else "")
        raise ValueError(f"{name} must be a finite number{limit} ({what}), got {value!r}")
    return v


def _interval(name: str, value, what: str) -> tuple[float, float] | None:
    if value is None:
        return None
    try:
        lo, hi_ = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be None or a (low, high) pair ({what}), got {value!r}") from None
    lo, hi_ = _number(f"{name}[0]", lo, what), _number(f"{name}[1]", hi_, what)
    if lo > hi_:
        raise ValueError(f"{name} must be a (low, high) pair with low <= high ({what}), got {value!r}")
    return lo, hi_


#: Where a Link's figures come from: by hand, a calibration dtlab ran (dtlab.calibrate, dtlab.load_profile), or a
#: cluster's nccl-tests output (dtlab.load_nccl_tests, dtlab.public_nccl_tests): collectives timed alone there.
ORIGINS = ("hand", "calibration", "nccl-tests")


@dataclass(frozen=True, kw_only=True)
class Regime:
    """One size regime of a piecewise fit (dtlab.model.fit.fit_piecewise): alpha (s) and beta (s/B) fitted on
    messages of min_bytes..max_bytes (bytes), with their (low, high) intervals where fitted."""

    min_bytes: float
    max_bytes: float
    alpha: float
    beta: float
    alpha_ci: tuple[float, float] | None = None
    beta_ci: tuple[float, float] | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "min_bytes", _number("min_bytes", self.min_bytes, "bytes", minimum=0))
        set_(self, "max_bytes", _number("max_bytes", self.max_bytes, "bytes", minimum=self.min_bytes))
        set_(self, "alpha", _number("alpha", self.alpha, "seconds per latency step", minimum=0))
        set_(self, "beta", _number("beta", self.beta, "seconds per byte", minimum=0))
        set_(self, "alpha_ci", _interval("alpha_ci", self.alpha_ci, "seconds"))
        set_(self, "beta_ci", _interval("beta_ci", self.beta_ci, "seconds per byte"))

    def end(self, side: int) -> Regime:
        """This regime at its intervals' low (side 0) or high (side 1) ends (at least 0); itself without them."""
        if self.alpha_ci is None or self.beta_ci is None:
            return self
        a, b = max(0.0, self.alpha_ci[side]), max(0.0, self.beta_ci[side])
        return dataclasses.replace(self, alpha=a, beta=b)


@dataclass(frozen=True, kw_only=True)
class Link:
    """One level's alpha-beta price of a collective, and what sharing the machine costs compute beside it.

    alpha: seconds per latency step (>= 0); beta: seconds per byte (>= 0; 0: unlimited bandwidth); form: 'ring' or
    'textbook' (dtlab.model.costmodel.FORMS); alpha_ci, beta_ci: (low, high) intervals of a fit, or None (by
    hand: no band);
    contention: how many times longer an all-reduce takes beside backward compute than idle (>= 1; 1: none);
    stretch: backward seconds lost per second of communication in flight beside it (>= 0; 0: none), with
    stretch_ci its (low, high) interval where fitted; source: where the figures come from, in words; how: one line
    per field saying measured, fitted or assumed (what :func:`dtlab.results.whatif.whatif` reports); origin: one of
    :data:`ORIGINS`; regimes: the size regimes of a piecewise fit, ascending (empty: alpha and beta price every
    size). A size is priced by the regime it falls in, boundaries at the geometric midpoint between neighbouring
    regimes (as Profile.predict does); alpha and beta stay the one line over every size. A copy with alpha or beta
    changed drops the regimes: it is then the one line given."""

    alpha: float
    beta: float
    form: str = "ring"
    alpha_ci: tuple[float, float] | None = None
    beta_ci: tuple[float, float] | None = None
    contention: float = 1.0
    stretch: float = 0.0
    stretch_ci: tuple[float, float] | None = None
    source: str = "given by hand"
    how: tuple[str, ...] = ()
    origin: str = "hand"
    regimes: tuple[Regime, ...] = ()

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise the numbers once, here
        set_(self, "alpha", _number("alpha", self.alpha, "seconds per latency step", minimum=0))
        set_(self, "beta", _number("beta", self.beta, "seconds per byte", minimum=0))
        if self.form not in costmodel.FORMS:
            raise ValueError(f"form must be one of {costmodel.FORMS}, got {self.form!r}")
        set_(self, "alpha_ci", _interval("alpha_ci", self.alpha_ci, "seconds"))
        set_(self, "beta_ci", _interval("beta_ci", self.beta_ci, "seconds per byte"))
        set_(self, "contention", _number("contention", self.contention, "loaded / idle all-reduce time", minimum=1))
        set_(self, "stretch", _number("stretch", self.stretch, "backward s lost per s in flight", minimum=0))
        set_(self, "stretch_ci", _interval("stretch_ci", self.stretch_ci, "backward s lost per s in flight"))
        if not isinstance(self.source, str):
            raise ValueError(f"source must be a string saying where the figures come from, got {self.source!r}")
        set_(self, "how", tuple(str(h) for h in self.how))
        if self.origin not in ORIGINS:
            raise ValueError(f"origin must be one of {ORIGINS}, got {self.origin!r}")
        regs = tuple(self.regimes) if isinstance(self.regimes, (tuple, list)) else None
        if regs is None or not all(isinstance(r, Regime) for r in regs):
            raise ValueError(f"regimes must be a tuple of Regime (dtlab.model.link.Regime), got {self.regimes!r}")
        if any(a.max_bytes > b.min_bytes for a, b in zip(regs, regs[1:])):
            raise ValueError("regimes must be ascending and apart: each one's max_bytes <= the next one's min_bytes")
        set_(self, "regimes", regs)

    def constants(self, nbytes):
        """(alpha, beta) that price `nbytes` (bytes; scalar or array): the regime each size falls in, or the one
        line alpha, beta without regimes."""
        if not self.regimes:
            return self.alpha, self.beta
        n = np.asarray(nbytes, dtype=float)
        edges = [math.sqrt(a.max_bytes * b.min_bytes) for a, b in zip(self.regimes, self.regimes[1:])]
        idx = np.searchsorted(edges, n, side="right")
        alphas = np.array([r.alpha for r in self.regimes])[idx]
        betas = np.array([r.beta for r in self.regimes])[idx]
        return (float(alphas), float(betas)) if np.ndim(n) == 0 else (alphas, betas)

    def time(self, op: str, nbytes, nproc):
        """Seconds of collective `op` ('all_reduce', 'reduce_scatter', 'all_gather', 'ps') of `nbytes` bytes on
        `nproc` ranks, idle (no compute beside it): dtlab.model.costmodel.collective_time in this link's form, each
        size at its regime's alpha and beta (:meth:`constants`)."""
        alpha, beta = self.constants(nbytes)
        return costmodel.collective_time(op, self.form, alpha, beta, nbytes, nproc)

    def replace(self, **changes) -> Link:
        """A copy with `changes` (field=value), validated like a new Link; a new alpha or beta without regimes
        drops the regimes (the copy is the one line given)."""
        if ("alpha" in changes or "beta" in changes) and "regimes" not in changes:
            changes["regimes"] = ()
        return dataclasses.replace(self, **changes)

    def bounds(self) -> tuple[Link, Link] | None:
        """(fast end, slow end) of the band: alpha and beta at their intervals' low ends (at least 0; beta above
        0) and high ends, stretch at its interval's ends where it has one; None without alpha and beta intervals."""
        if self.alpha_ci is None or self.beta_ci is None:
            return None
        s_ci = self.stretch_ci or (self.stretch, self.stretch)

        def end(side):  # every regime at the same end of its own interval
            a, b = max(0.0, self.alpha_ci[side]), max(0.0, self.beta_ci[side])
            regimes = tuple(r.end(side) for r in self.regimes)
            return dataclasses.replace(self, alpha=a, beta=b, stretch=max(0, s_ci[side]), regimes=regimes)

        return end(0), end(1)

    @classmethod
    def from_profile(cls, profile, op: str = "all_reduce", nproc: int | None = None, piecewise: bool = True) -> Link:
        """The Link of `profile`'s `op` fit (a Profile from dtlab.calibrate, dtlab.load_profile, an nccl-tests
        output or any other source): its alpha, beta, form and intervals, and with `piecewise` (default) the size
        regimes of its piecewise fit where it has more than one (each size priced by its own); where the profile
        was also timed under load (calibrate(..., load='backward')), the contention (loaded / idle all-reduce at 25
        MiB, at p = `nproc` or the largest p timed, at least 1) and the stretch it measured; otherwise 1 and 0, and
        `how` says why: an nccl-tests output times collectives alone, with nothing beside them to share with."""
        fits = getattr(profile, "fits", None)
        if fits is None:
            raise ValueError(f"profile must be a dtlab Profile (dtlab.load_profile), got {type(profile).__name__}")
        if op not in fits:
            raise ValueError(f"profile: op {op!r} has no fit in this profile; fitted ops: {sorted(fits)}")
        fit = fits[op]

        def ci(pair):  # a profile of recorded figures only carries NaN intervals: no band, not a made-up one
            pair = tuple(float(x) for x in pair) if pair is not None else ()
            return pair if len(pair) == 2 and all(math.isfinite(x) for x in pair) else None

        contention, c_how = contention_from_profile(profile, CONTENTION_AT_BYTES, nproc)
        stretch, s_how = stretch_from_profile(profile)
        st = ((profile.meta or {}).get("load") or {}).get("stretch") or {}
        meta = profile.meta or {}
        where = _where(meta.get("source")) or meta.get("host") or "a calibration"
        public = isinstance(meta.get("source"), dict) and meta["source"].get("format") == "nccl-tests"
        if public:  # not missing: an nccl-tests output never has compute beside its collectives
            c_how = s_how = "none in an nccl-tests output (each collective timed alone, nothing beside it): 1 and 0"
        segs = list((getattr(profile, "segments", None) or {}).get(op) or []) if piecewise else []
        regimes = tuple(
            Regime(
                min_bytes=s.min_bytes,
                max_bytes=s.max_bytes,
                alpha=max(0.0, float(s.alpha)),
                beta=max(0.0, float(s.beta)),
                alpha_ci=ci(s.alpha_ci),
                beta_ci=ci(s.beta_ci),
            )
            for s in segs
        )
        regimes = regimes if len(regimes) > 1 else ()
        r_how = (
            f"regimes: {len(regimes)} size regimes of the piecewise fit ("
            + ", ".join(f"{fmt_bytes(r.min_bytes)}..{fmt_bytes(r.max_bytes)}" for r in regimes)
            + "), each size priced by its own"
            if regimes
            else "regimes: one line over every size (" + ("one regime fitted)" if piecewise else "piecewise=False)")
        )
        alpha, beta, b_how = max(0.0, float(fit.alpha)), float(fit.beta), ""
        if not beta > 0:  # a short, noisy sweep: the line falls with size; price bytes from the largest size instead
            alpha, beta, b_how = _through_largest(profile, op, fit.form, alpha)
        return cls(
            alpha=alpha,
            beta=beta,
            form=fit.form,
            alpha_ci=ci(fit.alpha_ci),
            beta_ci=ci(fit.beta_ci),
            contention=contention,
            stretch=stretch,
            stretch_ci=(float(st["lo"]), float(st["hi"])) if st else None,
            source=f"{op} {fit.form} fit of the profile from {where} ({fit.n_points} points, "
            f"{fit.min_bytes:,}..{fit.max_bytes:,} B)",
            how=(
                f"alpha, beta: fitted ({fit.confidence:.0%} intervals)"
                + (", a negative alpha clipped to 0" if fit.alpha < 0 else "")
                + b_how,
                r_how,
                f"contention: {c_how}",
                f"stretch: {s_how}",
            ),
            origin="nccl-tests" if public else "calibration",
            regimes=regimes,
        )


@dataclass(frozen=True, kw_only=True)
class TwoLevelLink:
    """Nodes of `gpus_per_node` ranks: an intra-node Link (NVLink, PCIe, shared memory) and an inter-node Link (the
    network), an all-reduce priced by dtlab.model.hierarchy ('hierarchical': reduce-scatter in the node, all-reduce
    of the shard across nodes, all-gather in the node; 'flat': one ring over all ranks, each step as slow as its
    slowest edge), the node's `nics_per_node` network links shared by its rings. A job of at most gpus_per_node
    ranks stays in one node: the intra Link alone. The compute beside it shares the node, so contention and
    stretch are the intra Link's."""

    intra: Link
    inter: Link
    gpus_per_node: int
    algorithm: str = "hierarchical"
    nics_per_node: int = 1

    def __post_init__(self):
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise ValueError(f"{name} must be a Link (dtlab.model.link.Link), got {getattr(self, name)!r}")
        for name in ("gpus_per_node", "nics_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        if self.algorithm not in hi.ALGORITHMS:
            raise ValueError(f"algorithm must be one of {hi.ALGORITHMS}, got {self.algorithm!r}")

    @property
    def form(self) -> str:
        return f"two-level {self.algorithm}"

    @property
    def contention(self) -> float:
        return self.intra.contention

    @property
    def origin(self) -> str:
        """The levels' origin (:data:`ORIGINS`) where they share one, else 'mixed'."""
        return self.intra.origin if self.intra.origin == self.inter.origin else "mixed"

    @property
    def stretch(self) -> float:
        return self.intra.stretch

    @property
    def source(self) -> str:
        return f"inside a node: {self.intra.source}; between nodes: {self.inter.source}"

    @property
    def how(self) -> tuple[str, ...]:
        return tuple(f"intra: {h}" for h in self.intra.how) + tuple(f"inter: {h}" for h in self.inter.how)

    def nodes(self, nproc: int) -> int:
        """Nodes a job of `nproc` ranks fills: 1 up to gpus_per_node, else nproc / gpus_per_node (whole nodes)."""
        p = int(nproc)
        if p <= self.gpus_per_node:
            return 1
        if p % self.gpus_per_node:
            raise ValueError(
                f"nproc must fill whole nodes of gpus_per_node = {self.gpus_per_node} ranks (or fit in one), got {p}"
            )
        return p // self.gpus_per_node

    def time(self, op: str, nbytes, nproc):
        """Seconds of an all-reduce of `nbytes` bytes on `nproc` ranks (only 'all_reduce' has a two-level form)."""
        if int(nproc) <= self.gpus_per_node:
            return self.intra.time(op, nbytes, nproc)
        if op != "all_reduce":
            raise ValueError(f"op must be 'all_reduce' for a two-level link across nodes, got {op!r}")
        n = self.nodes(nproc)
        levels = (*self.intra.constants(nbytes), *self.inter.constants(nbytes))  # each level's regime per size
        return hi.two_level_time(self.algorithm, *levels, nbytes, n, self.gpus_per_node, self.nics_per_node)

    def replace(self, **changes) -> TwoLevelLink:
        """A copy with `changes`; contention and stretch go to the intra Link."""
        intra = {k: changes.pop(k) for k in ("contention", "stretch") if k in changes}
        out = dataclasses.replace(self, **changes)
        return dataclasses.replace(out, intra=out.intra.replace(**intra)) if intra else out

    def bounds(self) -> tuple[TwoLevelLink, TwoLevelLink] | None:
        """(fast end, slow end): both levels at their bands' ends; None unless both levels have one."""
        a, b = self.intra.bounds(), self.inter.bounds()
        if a is None or b is None:
            return None
        return self.replace(intra=a[0], inter=b[0]), self.replace(intra=a[1], inter=b[1])

    @classmethod
    def from_node_counts(cls, one_node, nodes, op: str = "all_reduce") -> TwoLevelLink:
        """Nodes of a real system from two outputs of the same collective (nccl-tests, or any Profile): `one_node`
        timed inside one node, `nodes` timed on whole nodes of as many ranks each. Inside a node: `one_node`'s fit.
        Across nodes: one ring over all ranks ('flat'), each step as slow as its slowest edge, the network edge
        priced by `nodes`' own ring fit (alpha per step, beta per byte of the n/p a step moves), so at the rank
        count `nodes` timed it gives that output's fit back; at other node counts it extrapolates."""
        counts = []
        for name, prof in (("one_node", one_node), ("nodes", nodes)):
            meta = getattr(prof, "meta", None)
            if meta is None or not getattr(prof, "fits", None):
                raise ValueError(f"{name} must be a dtlab Profile (dtlab.public_nccl_tests, dtlab.load_nccl_tests)")
            counts.append((int(meta.get("nnodes") or 1), int(meta.get("world_size") or 0)))
        (n1, p1), (n2, p2) = counts
        if n1 != 1 or p1 < 1:
            raise ValueError(f"one_node must be timed on one node with its rank count known, got {n1} node(s)")
        if n2 < 2 or p2 != n2 * p1:
            raise ValueError(
                f"nodes must be timed on 2 or more nodes of {p1} ranks each (one_node's count), "
                f"got {p2} rank(s) on {n2} node(s)"
            )
        return cls(
            intra=Link.from_profile(one_node, op),
            inter=Link.from_profile(nodes, op),
            gpus_per_node=p1,
            algorithm="flat",
        )

    @classmethod
    def from_profiles(cls, intra, inter, gpus_per_node: int, op: str = "all_reduce", **kw) -> TwoLevelLink:
        """A TwoLevelLink from a profile measured inside a node and one across nodes (one rank per node), each
        through :meth:`Link.from_profile`; `kw`: algorithm, nics_per_node."""
        return cls(
            intra=Link.from_profile(intra, op), inter=Link.from_profile(inter, op), gpus_per_node=gpus_per_node, **kw
        )


def _through_largest(profile, op: str, form: str, alpha: float) -> tuple[float, float, str]:
    """(alpha s, beta s/B, how) when a fit's beta is not above 0: a line through the largest size's median time (at
    the most ranks timed there) that keeps the fitted `alpha` when that size took longer than alpha's terms, else
    starts at 0, so that no size is priced as free."""
    s = profile.samples[profile.samples["op"] == op]
    if "load" in s.columns:
        s = s[s["load"].fillna("idle") == "idle"]  # what the fit was made of: the idle timings
    n = float(s["nbytes"].max())
    big = s[s["nbytes"] == n]
    p = int(big["nproc"].max())
    t = float(big[big["nproc"] == p]["seconds"].median())
    per_beta = float(costmodel.collective_time(op, form, 0.0, 1.0, n, p))
    left = t - float(costmodel.collective_time(op, form, alpha, 0.0, n, p))
    if left <= 0:
        alpha, left = 0.0, t
    return (
        alpha,
        left / per_beta,
        (
            f", the fitted beta ({profile.fits[op].beta:.3g} s/B) not above 0 (noise larger than the bandwidth term "
            f"over the sizes timed): beta from the {n / 2**20:.3g} MiB median at p = {p}"
            + (" and alpha 0" if alpha == 0 else ", through the fitted alpha")
            + "; time larger sizes"
        ),
    )


def _where(source) -> str | None:
    """A profile's source in words: a string as is; a loaded nccl-tests output (a dict) as its system's name and
    posted source URL, or its file."""
    if not isinstance(source, dict):
        return source or None
    system = source.get("system") or {}
    name = system.get("name") or source.get("file") or "an nccl-tests output"
    return f"{name} (nccl-tests output, {system['source']})" if system.get("source") else f"{name} (nccl-tests output)"


def as_link(value, op: str = "all_reduce") -> Link | TwoLevelLink:
    """A Link or TwoLevelLink as given, or the Link of a Profile (:meth:`Link.from_profile`); a ValueError naming
    `link` for anything else."""
    if isinstance(value, (Link, TwoLevelLink)):
        return value
    if hasattr(value, "fits") and hasattr(value, "predict"):
        return Link.from_profile(value, op)
    raise ValueError(
        f"link must be a dtlab Profile, a Link or a TwoLevelLink (dtlab.model.link), got {type(value).__name__}"
    )


def one_level(value, op: str = "all_reduce", name: str = "link") -> Link:
    """A Link as given, or the Link of a Profile (:meth:`Link.from_profile`): one level's alpha, beta and form. A
    ValueError naming `name` for a TwoLevelLink (two levels have no single alpha and beta) or anything else."""
    if isinstance(value, TwoLevelLink):
        raise ValueError(
            f"{name} must be one level (a Link or a Profile), got a TwoLevelLink: pass its .intra or .inter Link"
        )
    if isinstance(value, Link) or (hasattr(value, "fits") and hasattr(value, "predict")):
        return as_link(value, op)
    raise ValueError(f"{name} must be a Link (dtlab.model.link.Link) or a dtlab Profile, got {type(value).__name__}")
