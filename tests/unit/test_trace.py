"""Chrome / Perfetto trace export: valid Trace Event JSON whose slices match the run's DataFrames."""

import json

import pytest


def test_lanes_never_overlap():
    from dtlab.results.chrome import _lanes

    ivs = [(0, 5), (1, 2), (2, 3), (4, 6), (5, 7), (2.5, 9)]
    lanes = _lanes(ivs)
    for k in set(lanes):
        mine = sorted(iv for iv, lane in zip(ivs, lanes) if lane == k)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))
    assert max(lanes) + 1 == 3  # the depth of the deepest overlap, not more


@pytest.mark.parametrize("name", ["h200-ddp", "h200-zero3"])
def test_the_streamed_trace_file_is_the_trace_dicts_json_byte_for_byte(tmp_path, name, monkeypatch):
    """write_chrome_trace writes an event at a time: the file must be exactly json.dumps of chrome_trace (same
    events, order, separators), and it must not build the whole dict first (a long run's millions of events)."""
    from dtlab.results import chrome
    from dtlab.results.recorded import recorded_run

    run = recorded_run(name).run
    whole = json.dumps(chrome.chrome_trace(run))
    monkeypatch.setattr(chrome, "chrome_trace", lambda run: pytest.fail("the writer built the whole trace"))
    path = chrome.write_chrome_trace(run, str(tmp_path / "trace.json"))
    text = open(path).read()
    assert text == whole
    assert json.loads(text)["traceEvents"]
