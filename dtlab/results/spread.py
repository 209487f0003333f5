"""How far a run's headline figures can be trusted: bootstrap intervals of medians over steps and over pairs, and
the rule that keeps a difference inside the machine's noise off the screen as a figure. Pure (numpy).

- An interval is a percentile bootstrap interval of the median (Efron & Tibshirani 1993, "An Introduction to the
  Bootstrap", ch. 13): the middle LEVEL (90%) of RESAMPLES medians of values drawn with replacement, by a
  generator seeded with SEED, so a run directory gives the same interval every time it is read; widened, where
  it is narrower, to the distribution-free interval of the median (`median_bounds`), which a handful of steps
  or pairs needs: with 6 pairs, the 90% interval of their median is their range.
- On a busy machine neighbouring steps share the load they ran under, and an independent resampling would count
  them as separate evidence: there the resamples are moving blocks of ceil(sqrt(n)) consecutive steps or pairs
  (Künsch 1989, "The jackknife and the bootstrap for general stationary observations", Annals of Statistics 17),
  which widens each interval by what the load's persistence adds (`block_for`).
- Exposed communication measured as a difference (T_step - T_comp) is shown as a figure only when its interval
  lies above 0: an interval that holds 0, or a baseline slower than the steps, is communication below this
  machine's noise, said in words with the noise's size (`exposed_words`).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

LEVEL = 0.90
"""The intervals' coverage: 90% (5% left out on either side)."""
RESAMPLES = 1000
"""Bootstrap resamples per interval, up to BUDGET values resampled in all (`resamples_for`)."""
BUDGET = 3_000_000
"""Values one set of resamples may draw: a 30,000-step run gets 200 resamples of its steps (tails of 10 on either
side of a 90% interval, whose width is then a small fraction of the median) instead of 30 million draws."""
SEED = 0
"""The resampling generator's seed: the same run directory gives the same intervals."""


def resamples_for(n: int) -> int:
    """RESAMPLES for up to BUDGET / RESAMPLES values (3,000 steps), fewer beyond, at least 200."""
    return RESAMPLES if n * RESAMPLES <= BUDGET else max(200, BUDGET // max(n, 1))


def block_for(n: int, busy: bool) -> int:
    """The resampling block: 1 (independent draws) on a quiet machine, ceil(sqrt(n)) on a busy one."""
    return max(1, math.ceil(math.sqrt(n))) if busy and n > 2 else 1


def resample_index(n: int, block: int, rng: np.random.Generator, resamples: int = RESAMPLES) -> np.ndarray:
    """(resamples, n) indices into n ordered values: independent draws (block 1), or moving blocks of `block`
    consecutive values laid end to end and cut at n."""
    if n <= 0:
        return np.zeros((resamples, 0), dtype=np.int64)
    block = min(max(int(block), 1), n)
    if block == 1:
        return rng.integers(0, n, size=(resamples, n), dtype=np.int32)
    k = -(-n // block)
    starts = rng.integers(0, n - block + 1, size=(resamples, k), dtype=np.int32)
    return (starts[:, :, None] + np.arange(block)).reshape(resamples, k * block)[:, :n]


WINDOW = 8.0
"""Half-width of the band of ranks around the middle that `medians` looks in, in units of sqrt(n) (a resample
median's rank strays from n/2 by about sqrt(n)/2 a standard deviation: 8 sqrt(n) is 16 of them)."""
WINDOWED = 2000
"""Values from which `medians` counts within the band instead of partitioning each resample."""


def medians(values, idx: np.ndarray) -> np.ndarray:
    """The median of each resample (one per row of `idx`); NaN for no values. For an even count, the mean of the
    two middle values. Exactly what one partition per row gives (numpy's median partitions around both middle
    values, which took twice as long on 3,000-step runs); from WINDOWED values, found by counting instead (`_counted`),
    three times faster at 100,000."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return np.full(idx.shape[0], np.nan)
    if idx.shape[1] >= WINDOWED:
        return _counted(v, idx)
    return _partitioned(v, idx)


def _partitioned(v: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """One partition per row: the upper middle value, and for an even count the largest value left of it."""
    x = v[idx]
    n = x.shape[1]
    k = n // 2
    x.partition(k, axis=1)
    return x[:, k] if n % 2 else (x[:, k] + x[:, :k].max(axis=1)) / 2


def _counted(v: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The middle values of each resample from their ranks among the sorted values: each resample's draws below a
    band of ranks around the middle are counted, those inside it are counted rank by rank, and the middle one is
    read off the running count. A resample whose middle falls outside the band (never seen, but possible) is
    partitioned as `_partitioned` does. Ties and NaN (sorted last, as a partition puts them) give the same values."""
    b, n = idx.shape
    order = np.argsort(v, kind="stable")
    ranked = v[order]
    rank = np.empty(n, dtype=np.int32)
    rank[order] = np.arange(n, dtype=np.int32)
    k = n // 2
    half = int(WINDOW * math.sqrt(n)) + 2
    lo = max(k - 1 - half, 0)
    width = min(k + half + 1, n) - lo
    d = rank[idx]
    d -= lo  # the band is 0 <= d < width
    below = (d < 0).sum(axis=1)
    rows, cols = np.nonzero(d.view(np.uint32) < width)
    cum = np.cumsum(np.bincount(rows * width + d[rows, cols], minlength=b * width).reshape(b, width), axis=1)

    def middle(j: int) -> tuple[np.ndarray, np.ndarray]:
        t = j - below  # the j-th value of the resample is the t-th inside the band
        found = (t >= 0) & (t < cum[:, -1])
        at = np.minimum((cum <= t[:, None]).sum(axis=1), width - 1)
        return ranked[lo + at], found

    out, found = middle(k)
    if not n % 2:
        left, also = middle(k - 1)
        out, found = (out + left) / 2, found & also
    if not found.all():
        missed = np.flatnonzero(~found)
        out[missed] = _partitioned(v, idx[missed])
    return out


def interval(replicates, level: float = LEVEL) -> tuple[float, float]:
    """(lo, hi): the middle `level` of the replicates (NaN, NaN when there are none)."""
    r = np.asarray(replicates, dtype=float)
    r = r[np.isfinite(r)]
    if r.size == 0:
        return math.nan, math.nan
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(r, [a, 1.0 - a])
    return float(lo), float(hi)


def median_bounds(values, level: float = LEVEL) -> tuple[float, float]:
    """The distribution-free interval of a median, from order statistics (the sign test's interval: Conover 1999,
    "Practical Nonparametric Statistics", 3.2): [x_(k+1), x_(n-k)] for the largest k whose binomial coverage
    1 - 2 P(Bin(n, 1/2) <= k) is at least `level`; with too few values for that (4 or fewer at 90%), their range.
    A bootstrap interval of the median is too narrow for a handful of values (its resamples take only the few
    middle ones); the breakdown shows the wider of the two."""
    v = np.asarray(values, dtype=float).ravel()
    v = np.sort(v[np.isfinite(v)])
    n = v.size
    if n == 0:
        return math.nan, math.nan
    k = _drop(n, (1.0 - level) / 2)
    return float(v[k]), float(v[n - 1 - k])


def _drop(n: int, tail: float) -> int:
    """How many values each side of a sorted sample the median's interval leaves out: the largest k with
    P(Bin(n, 1/2) <= k) <= tail (exact up to 1,000 values, the normal approximation beyond), at least 0."""
    if n > 1000:
        return max(0, int(math.floor(n / 2 - NormalDist().inv_cdf(1 - tail) * math.sqrt(n) / 2 - 0.5)))
    total, cdf, k = 2**n, 0, 0
    for j in range(n // 2 + 1):
        cdf += math.comb(n, j)
        if cdf / total > tail:
            break
        k = j
    return min(k, (n - 1) // 2)


def hull(*intervals) -> tuple[float, float]:
    """The smallest interval holding every finite (lo, hi) given (NaN, NaN when none is finite)."""
    los = [a for a, _ in intervals if a == a]
    his = [b for _, b in intervals if b == b]
    return (min(los) if los else math.nan), (max(his) if his else math.nan)


def resolved(lo: float) -> bool:
    """A difference is shown as a figure only when its whole interval lies above 0."""
    return lo == lo and lo > 0


def exposed_words(median: float, lo: float, hi: float, n: int, per: str) -> str:
    """What replaces an exposed time inside the noise: how large the noise is (half the interval, ms) and why."""
    noise = (hi - lo) / 2 if lo == lo and hi == hi else math.nan
    size = f"±{noise * 1e3:.0f} ms" if noise == noise else "unknown"
    if median == median and median < 0:
        why = (
            f"the no-op-hook steps took {-median * 1e3:.0f} ms longer than the training steps they were "
            f"compared with, median over {n} {per}"
        )
    else:
        why = f"the {LEVEL:.0%} interval of the median over {n} {per} holds 0"
    return f"communication is below this machine's noise here: {size} ({why})"


def overlap_words(exposed_hi: float, t_comm: float) -> str:
    """What replaces the overlap when exposed is inside the noise: a lower bound where the noise allows one."""
    if t_comm == t_comm and t_comm > 0 and exposed_hi == exposed_hi and 0 <= exposed_hi < t_comm:
        return (
            f"at least {1 - exposed_hi / t_comm:.2f} (exposed is within the noise, at most "
            f"{exposed_hi * 1e3:.0f} ms of the {t_comm * 1e3:.0f} ms in flight)"
        )
    return "not measurable here: exposed is within this machine's noise"
