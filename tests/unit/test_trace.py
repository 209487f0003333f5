"""Chrome / Perfetto trace export: valid Trace Event JSON whose slices match the run's DataFrames."""


def test_lanes_never_overlap():
    from dtlab.results.chrome import _lanes

    ivs = [(0, 5), (1, 2), (2, 3), (4, 6), (5, 7), (2.5, 9)]
    lanes = _lanes(ivs)
    for k in set(lanes):
        mine = sorted(iv for iv, lane in zip(ivs, lanes) if lane == k)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))
    assert max(lanes) + 1 == 3  # the depth of the deepest overlap, not more
