"""The one place units are formatted for screens."""

from dtlab.units import fmt_bytes, fmt_gbps, fmt_mib, fmt_ms, fmt_us


def test_formats_name_their_units():
    assert fmt_bytes(512) == "512 B" and fmt_bytes(4096) == "4 KiB" and fmt_bytes(25 * 2**20) == "25 MiB"
    assert fmt_mib(0.25) == "0.25" and fmt_mib(1024) == "1024"
    assert fmt_ms(0.0123) == "12.3 ms" and fmt_ms(float("nan")) == "n/a" and fmt_ms(0.5, width=8) == "   500.0 ms"
    assert fmt_us(8.4e-6) == "8.4 us"
    assert fmt_gbps(125e6) == "0.125 GB/s" and fmt_gbps(0) == "inf"


def test_union_length_counts_overlaps_once():
    from dtlab.intervals import union_length

    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
    assert union_length([]) == 0.0 and union_length([(1, 1)]) == 0.0
