"""dtlab.course.claims: a lab's statements about outcomes are computed from its measurements, and a record read
back from a notebook can be checked against its own numbers. Pure: no runs (a fake `run` for the ordering)."""

import json

import pytest

from dtlab.course.claims import Spread, compare, consistent, outcome_of, parse_claims, spread
from dtlab.course.claims.runs import interleaved, order_text


def test_spread_and_the_three_outcomes():
    assert spread([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0, 3)
    assert spread([1.0, 2.0]).median == 1.5
    with pytest.raises(ValueError, match="finite"):
        spread([float("nan")])
    # within ±25% of x0.25: the median decides holds; the whole range outside decides contradicted
    assert outcome_of(Spread(0.26, 0.2, 0.3, 3), 0.25, "within", 0.25) == "holds"
    assert outcome_of(Spread(0.9, 0.8, 1.1, 3), 0.25, "within", 0.25) == "contradicted"
    assert outcome_of(Spread(0.5, 0.3, 0.7, 3), 0.25, "within", 0.25) == "inconclusive"
    # below: every run's ratio under 1, every run over 1, or both
    assert outcome_of(Spread(0.7, 0.6, 0.9, 2), 0.5, "below", 0) == "holds"
    assert outcome_of(Spread(3.5, 1.2, 4.0, 2), 0.5, "below", 0) == "contradicted"
    assert outcome_of(Spread(0.9, 0.7, 1.1, 2), 0.5, "below", 0) == "inconclusive"
    assert outcome_of(Spread(1.8, 1.5, 2.0, 2), 1.8, "above", 0) == "holds"
    with pytest.raises(ValueError, match="test must be one of"):
        outcome_of(Spread(1, 1, 1, 1), 1, "roughly", 0)


def test_a_claim_that_does_not_hold_must_say_why():
    a, b = ("accumulate 4", [0.0009, 0.0008]), ("none", [0.001, 0.001])
    with pytest.raises(ValueError, match="give `why`"):
        compare(
            "lab.x",
            "accumulation cuts T_comm per sample by K",
            "T_comm per sample",
            a,
            b,
            expected=0.25,
            model="1/K",
            min_n=1,
        )
    c = compare(
        "lab.x",
        "accumulation cuts T_comm per sample by K",
        "T_comm per sample",
        a,
        b,
        expected=0.25,
        model="1/K",
        why=lambda outcome: f"{outcome}: the wait for the peer grew",
        min_n=1,
    )
    assert c.outcome == "contradicted" and c.why == "contradicted: the wait for the peer grew"
    text = c.text()
    assert "accumulate 4 850 µs, none 1 ms" in text and "×0.85 (range ×0.8 .. ×0.9)" in text
    assert "Outcome: CONTRADICTED" in text and "2 run(s) each" in text
    ok = compare(
        "lab.y",
        "fp16 halves the bytes",
        "bytes on the wire",
        ("fp16", [2.0, 2.0]),
        ("none", [4.0, 4.0]),
        expected=0.5,
        model="2 of 4 bytes",
        unit="B",
        rel_tol=0.01,
        why="never used",
    )
    assert ok.holds and ok.why is None and "fp16 2 B" in ok.text()


def test_consistent_finds_a_record_whose_outcome_does_not_follow_from_its_numbers():
    c = compare("lab.z", "s", "q", ("a", [1.0, 1.1]), ("b", [2.0, 2.0]), expected=0.5, model="m", rel_tol=0.2)
    rec = json.loads(json.dumps(c.record()))
    assert consistent(rec) == []
    assert consistent(dict(rec, outcome="contradicted"))  # prints an outcome its numbers do not give
    assert consistent(dict(rec, ratios=dict(rec["ratios"], median=9.0)))  # median outside its own range
    bad = dict(rec, outcome="inconclusive", ratios=dict(rec["ratios"], median=0.9, lo=0.6, hi=1.0), why=None)
    assert any("without a reason" in p for p in consistent(bad))


def test_a_claim_about_time_from_fewer_than_three_runs_is_inconclusive():
    a, b = ("accumulate 4", [0.0009, 0.0008]), ("none", [0.001, 0.001])
    c = compare(
        "lab.x",
        "accumulation cuts T_comm per sample by K",
        "T_comm per sample",
        a,
        b,
        expected=0.25,
        model="1/K",
        why="the wait for the peer grew",
    )
    assert c.outcome == "inconclusive" and "2 run(s) only" in c.why and "would say contradicted" in c.why
    assert "the wait for the peer grew" in c.why and "from at least 3 runs" in c.text()
    assert consistent(json.loads(json.dumps(c.record()))) == []
    assert consistent(dict(json.loads(json.dumps(c.record())), outcome="contradicted"))


def test_interleaved_runs_alternate_the_order():
    made = []
    out = interleaved({"A": "a", "B": "b", "C": "c"}, 3, run=lambda cfg: made.append(cfg) or cfg.upper())
    assert made == list("abccbaabc") and out == {"A": ["A"] * 3, "B": ["B"] * 3, "C": ["C"] * 3}
    assert order_text(["A", "B"], 2) == "interleaved: A B, then B A"
    assert order_text(["A", "B"], 1) == "one run each, in the order A B"
    with pytest.raises(ValueError, match="repeats"):
        interleaved({"A": 1}, 0, run=print)


def test_parse_claims_reads_the_records_back(tmp_path, capsys):
    c = compare("lab.w", "s", "q", ("a", [1.0]), ("b", [2.0]), expected=0.5, model="m", min_n=1).show()
    printed = capsys.readouterr().out
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "outputs": [
                    {"output_type": "stream", "name": "stdout", "text": printed},
                    {"output_type": "display_data", "data": {"application/vnd.dtlab.claim+json": c.record()}},
                ],
            }
        ]
    }
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    got = parse_claims(path)
    assert [r["cid"] for r in got] == ["lab.w", "lab.w"] and got[0]["outcome"] == "holds"


def test_unpaired_values_compare_the_middle_halves():
    c = compare(
        "lab.u",
        "1 MiB takes longer than 4 KiB",
        "time per call",
        ("1 MiB", [1.0, 2.0, 3.0, 4.0, 5.0]),
        ("4 KiB", [2.0, 3.0, 4.0]),
        expected=None,
        model="beta n on top of alpha",
        test="above",
        per="call",
        paired=False,
        why="calls overlap",
    )
    # quartiles (2, 3, 4) and (2.5, 3, 3.5): 2/3.5 .. 4/2.5 around 3/3
    assert c.ratios.median == 1.0 and c.ratios.lo == pytest.approx(2 / 3.5) and c.ratios.hi == pytest.approx(1.6)
    assert c.outcome == "inconclusive" and c.why == "calls overlap"
    assert "1 MiB / 4 KiB above ×1" in c.text() and "quartiles of 5 x 3 unpaired calls" in c.text()
    assert consistent(json.loads(json.dumps(c.record()))) == []
    one_stray = compare(
        "lab.v",
        "s",
        "q",
        ("big", [3.0, 3.1, 3.2, 0.1]),
        ("small", [1.0, 1.1, 1.2, 5.0]),
        expected=None,
        model="m",
        test="above",
        paired=False,
    )
    assert one_stray.holds  # a single stray call each does not decide
