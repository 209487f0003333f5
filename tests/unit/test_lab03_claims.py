"""Lab 3's claim about the what-if beside the sweep (dtlab.course.claims.lab03.whatif_claim): hand-computed cases."""

import pandas as pd

from dtlab.course.claims import consistent
from dtlab.course.claims.lab03 import whatif_claim


def _table(predicted_ms, measured_ms, half=0.1):
    m = pd.Series(measured_ms, dtype=float)
    return pd.DataFrame(
        {
            "bucket_mb": [1.0, 5.0, 25.0],
            "measured_t_step_ms": m,
            "measured_lo_ms": m * (1 - half),
            "measured_hi_ms": m * (1 + half),
            "whatif_t_step_ms": predicted_ms,
        }
    )


def test_within_the_spread_holds():
    # ratios 1.05, 0.95, 1.05: median 1.05, inside the ±10% band (every run's interval is ±10% of its median)
    c = whatif_claim(_table([1050, 1900, 4200], [1000, 2000, 4000]), how="3 runs")
    assert c.outcome == "holds" and c.rel_tol == 0.1 and c.ratios.median == 1.05
    assert not consistent(c.record())


def test_every_cap_outside_the_spread_is_contradicted_and_says_where():
    # ratios 1.5, 1.6, 1.5: every one above the ±10% band
    c = whatif_claim(_table([1500, 3200, 6000], [1000, 2000, 4000]), how="3 runs")
    assert c.outcome == "contradicted" and "0 of 3 caps" in c.why and "+60% at 5 MiB" in c.why
    # ratios 1.5, 1.5, 0.5: on both sides of the band, the caps disagree
    assert whatif_claim(_table([1500, 3000, 2000], [1000, 2000, 4000]), how="3 runs").outcome == "inconclusive"
    assert not consistent(c.record())
