"""Stragglers: slow one rank's compute by a known amount and watch the others wait for it.

`RunConfig.stragglers.slow` (flat name `straggler`, `--straggler`) is a comma-separated list of `RANK:FACTOR` or
`RANK:+MSms` entries:

- `1:2`       rank 1's compute takes 2x as long: it sleeps (FACTOR - 1) x its own compute time per step;
- `1:+150ms`  rank 1 sleeps exactly 150 ms per step;
- `1:1.2,2:1.1`: three ranks whose compute takes 1.0, 1.2 and 1.1 times the first's (1000 / 1200 / 1100 ms).

Where and how much (`DELAY_RULE`, also recorded in config.json as `resolved.straggler`): the straggler sleeps
once per step, after its (last micro-batch's) forward pass and before that backward, so every gradient bucket
it issues is late by the delay. The sleep is part of its backward time (`t_bwd`) and happens before each bucket's
`t_ready`, exactly as a slower backward would; each step event records the delay actually slept, `straggle_s`
(the wall clock around the sleep: the "known amount" is what was slept, not what was asked for). Baseline steps
(no-op comm hook) sleep too, so the measured T_comp is the slowest rank's compute, straggle included.

Pure and dependency-free: the ranks import it. Per-rank wait times are computed in `dtlab.results.stragglers`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dtlab.config.options import label

#: How many of the rank's own earlier steps the FACTOR rule takes the median of.
HISTORY_STEPS = 3

DELAY_RULE = (
    "The straggler sleeps once per step, after its last forward pass and before that backward. "
    "RANK:+MSms sleeps MS milliseconds. RANK:FACTOR sleeps (FACTOR - 1) x C, C = the median of the rank's own "
    f"compute in its last {HISTORY_STEPS} steps after step 0 (step 0 allocates), where a step's compute is "
    "t_fwd + backward until its last gradient bucket was ready + t_opt, minus the delay it slept: no waiting "
    "for peers is in C, since every bucket is issued asynchronously. Before such a step exists (steps 0 and 1, "
    "or baseline steps of a run with none), C = 3 x the time from the step start to the sleep (forward, with "
    "backward ~ 2 x forward). On GPU the rank synchronises its stream before sleeping, so the GPU idles for the "
    "delay too. Each step event records the delay actually slept as straggle_s (s)."
)

_ENTRY = re.compile(r"^\s*(?P<rank>[^:]*?)\s*:\s*(?P<value>.*?)\s*$")
_MS = re.compile(r"^\+\s*(?P<ms>[^\s].*?)\s*ms$", re.IGNORECASE)


@dataclass(frozen=True)
class Straggle:
    """One straggling rank: compute stretched by `factor` (>= 1), or a fixed `delay_ms` (ms) per step."""

    rank: int
    """The slowed rank, in [0, nproc)."""
    factor: float | None = None
    """The rank's compute takes `factor` x as long (None for a fixed delay)."""
    delay_ms: float | None = None
    """A fixed delay per step in ms (None for a factor)."""

    def describe(self) -> str:
        """'rank 1: compute x 2' or 'rank 1: +150 ms per step'."""
        return (
            f"rank {self.rank}: compute x {self.factor:g}"
            if self.factor is not None
            else f"rank {self.rank}: +{self.delay_ms:g} ms per step"
        )


@dataclass(kw_only=True)
class StragglersConfig:
    """Slowed ranks (`RunConfig.stragglers`; flat name straggler): read by the strategies whose spec says
    `stragglers` (their rank loop injects the delay, dtlab.rank.strategies.bases.Straggler)."""

    slow: str | None = None
    """Which ranks are slowed and how: 'RANK:FACTOR' (compute x FACTOR) or 'RANK:+MSms', comma-separated
    ('1:2.0', '0:+30ms,1:1.5'); None slows nobody. See the module docstring for where the delay goes."""

    def validate(self) -> None:
        """The field on its own (ValueError naming it); dtlab.config.rules parses it against the ranks."""
        if self.slow is not None and not isinstance(self.slow, str):
            raise ValueError(
                f"{label('stragglers', 'slow')} must be None or a string like '1:2.0' or '0:+30ms', got {self.slow!r}"
            )


def parse_straggler(spec: str, nproc: int) -> dict[int, Straggle]:
    """{rank: Straggle} from a `straggler` spec ("1:2", "1:+150ms", "1:1.2,2:1.1") for a run of `nproc`
    ranks. Raises ValueError naming `straggler` and what is allowed: rank an integer in [0, nproc), FACTOR a
    finite number >= 1, MS a finite number >= 0, no rank twice."""
    allowed = "'RANK:FACTOR' or 'RANK:+MSms', comma-separated (e.g. '1:2', '1:+150ms', '1:1.2,2:1.1')"
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"straggler must be a string {allowed} or None, got {spec!r}")
    out: dict[int, Straggle] = {}
    for entry in spec.split(","):
        m = _ENTRY.match(entry)
        if not m:
            raise ValueError(f"straggler entry {entry.strip()!r} is not {allowed}")
        rank = _rank(m.group("rank"), nproc, entry)
        if rank in out:
            raise ValueError(f"straggler names rank {rank} twice ({spec!r}): one entry per rank")
        value = m.group("value")
        ms = _MS.match(value)
        if ms:
            out[rank] = Straggle(rank, delay_ms=_number(ms.group("ms"), 0.0, "delay MS (ms)", entry))
        else:
            if value.lower().endswith("ms") or value.startswith("+"):
                raise ValueError(
                    f"straggler entry {entry.strip()!r}: a delay is written '+MSms' "
                    f"(e.g. '{rank}:+150ms'), a factor as a plain number (e.g. '{rank}:2')"
                )
            out[rank] = Straggle(rank, factor=_number(value, 1.0, "FACTOR", entry))
    return out


def _rank(text: str, nproc: int, entry: str) -> int:
    text = text.strip()
    if not re.fullmatch(r"[0-9]+", text) or not 0 <= int(text) < nproc:
        raise ValueError(
            f"straggler rank must be an integer in [0, nproc) = [0, {nproc}) (nproc = {nproc}), "
            f"got {text!r} in {entry.strip()!r}"
        )
    return int(text)


def _number(text: str, low: float, what: str, entry: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < low:
        raise ValueError(f"straggler {what} must be a finite number >= {low:g}, got {text!r} in {entry.strip()!r}")
    return v


def straggler_plan(spec: str | None, nproc: int) -> dict | None:
    """What config.json records under `resolved.straggler`: the spec, each slowed rank and the delay rule."""
    if spec is None:
        return None
    parsed = parse_straggler(spec, nproc)
    return {
        "spec": spec,
        "ranks": {
            str(r): {"factor": s.factor, "delay_ms": s.delay_ms, "what": s.describe()}
            for r, s in sorted(parsed.items())
        },
        "rule": DELAY_RULE,
    }
