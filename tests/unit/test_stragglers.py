"""Stragglers: `straggler` slows a rank's compute by a known, recorded amount; each rank's wait time is
measured from the recorded buckets without comparing clocks; bad specs are refused before launch by name."""

import pandas as pd
import pytest

import dtlab
from dtlab.cli.main import main as cli_main
from dtlab.config.run import tiny
from dtlab.config.stragglers import Straggle, parse_straggler
from dtlab.rank.strategies.bases import Straggler, ddp_compute_s
from dtlab.results.stragglers import (
    bucket_waits,
    rank_waits,
    sync_step_model,
    wait_summary,
)
from dtlab.viz.stragglers import wait_per_step, who_waited


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(straggler="2:2"), r"straggler rank must be an integer in \[0, nproc\) = \[0, 2\).*'2'"),
        (dict(straggler="0:1.5,3:+5ms", nproc=3), r"straggler rank .*\[0, 3\).*'3'"),
        (dict(straggler="-1:2"), r"straggler rank"),
        (dict(straggler="1:0.5"), r"straggler FACTOR must be a finite number >= 1, got '0.5'"),
        (dict(straggler="1:nan"), r"straggler FACTOR must be a finite number"),
        (dict(straggler="1:+-3ms"), r"straggler delay MS \(ms\) must be a finite number >= 0"),
        (dict(straggler="1:+infms"), r"straggler delay MS"),
        (dict(straggler="1:150ms"), r"straggler entry '1:150ms': a delay is written '\+MSms'"),
        (dict(straggler="1"), r"straggler entry '1' is not 'RANK:FACTOR' or 'RANK:\+MSms'"),
        (dict(straggler="1:2,1:3"), r"straggler names rank 1 twice"),
        (dict(straggler=" "), r"straggler must be a string"),
        (dict(straggler="1:2", strategy="zero3"), r"straggler '1:2' applies to strategy 'ddp' or 'ps' only"),
        (dict(straggler="1:2", record=False), r"straggler needs record=True"),
    ],
)
def test_bad_stragglers_are_refused_by_name(changes, needle):
    with pytest.raises(ValueError, match=needle):
        tiny(**changes).validate(cuda_device_count=0)


def test_good_specs_parse():
    assert parse_straggler("1:1.2, 2:1.1", 3) == {1: Straggle(1, factor=1.2), 2: Straggle(2, factor=1.1)}
    assert parse_straggler("0:+150ms,1:1", 2) == {0: Straggle(0, delay_ms=150.0), 1: Straggle(1, factor=1.0)}
    tiny(straggler="1:2").validate(cuda_device_count=0)


def test_straggler_rank_out_of_range_refused_before_launch(tmp_path, capsys):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match="straggler rank"):
        dtlab.launch(tiny(straggler="2:2", out=str(out)))
    assert cli_main(["run", "--model", "tiny", "--nproc", "2", "--straggler", "5:2", "--out", str(out)]) == 2
    assert "straggler rank must be an integer in [0, nproc)" in capsys.readouterr().err
    assert not out.exists()  # nothing was created or started


def test_delay_rule_fixed_and_factor():
    assert Straggler("1:+150ms", 1, 2).delay_s(0.01) == pytest.approx(0.150)
    assert Straggler("1:2", 0, 2).delay_s(0.01) == 0.0 and not Straggler(None, 0, 2).active
    s = Straggler("1:1.5", 1, 2)
    assert s.delay_s(0.010) == pytest.approx(0.5 * 3 * 0.010)  # no history: 3 x the forward
    s.observe(0, 9.0)  # step 0 allocates: never used
    for step, c in enumerate([0.10, 0.40, 0.20, 0.30], start=1):
        s.observe(step, c)
    assert s.delay_s(0.010) == pytest.approx(0.5 * 0.30)  # median of the last 3 steps (0.40, 0.20, 0.30)
    # a step's compute: until its last bucket was ready + optimizer, the delay slept taken out
    assert ddp_compute_s([{"t_ready": 0.05}, {"t_ready": 0.08}], 0.01, 0.03) == pytest.approx(0.06)
    assert ddp_compute_s([], 0.01, 0.0) is None


def _synthetic(comp, offsets, comm=0.010, fractions=(0.5, 1.0), steps=(0, 1)):
    """Buckets as ranks would record them: rank i's bucket b is ready at comp[i] x fractions[b] on its own clock
    (which starts offsets[i] s after a shared origin) and the collective ends for everyone when the last rank
    has issued it, plus `comm`."""
    rows, st = [], []
    for s in steps:
        for b, f in enumerate(fractions):
            end_abs = max(o + c * f for c, o in zip(comp, offsets)) + comm
            for r, (c, o) in enumerate(zip(comp, offsets)):
                rows.append(dict(rank=r, step=s, bucket=b, t_ready=c * f, t_start=c * f, t_end=end_abs - o))
        st += [dict(rank=r, step=s, t_opt=0.002, t_step=1.3, straggle_s=0.0) for r in range(len(comp))]
    return pd.DataFrame(rows), pd.DataFrame(st)


def test_waits_reproduce_seed_002():
    buckets, steps = _synthetic([1.0, 1.2, 1.1], [0.0, 0.0, 0.0])
    w = rank_waits(buckets, steps)
    assert len(w) == 6 and set(w.columns) >= {"rank", "step", "wait_s", "waited_for", "t_comp_s", "straggle_s"}
    med = wait_summary(w).set_index("rank")
    assert med["wait_s"].tolist() == pytest.approx([0.2, 0.0, 0.1])  # the max over buckets, not the sum (0.3)
    assert med.loc[0, "waited_for"] == 1 and med.loc[2, "waited_for"] == 1 and pd.isna(med.loc[1, "waited_for"])
    assert med["t_comp_s"].tolist() == pytest.approx([1.002, 1.202, 1.102])  # last ready + optimizer
    model = sync_step_model([1.0, 1.2, 1.1], t_comm_s=0.01)
    assert model["wait_s"].tolist() == pytest.approx(med["wait_s"].tolist())
    assert model["t_step_s"].tolist() == pytest.approx([1.21] * 3) and model["waited_for"].tolist()[0] == 1
    bw = bucket_waits(buckets)
    assert bw[bw.bucket == 0].groupby("rank")["wait_s"].max().values == pytest.approx([0.1, 0.0, 0.05])


def test_waits_need_no_common_clock():
    # each rank's step clock starts at a different moment: its times shift, its durations do not
    same = rank_waits(*_synthetic([1.0, 1.2, 1.1], [0.0, 0.0, 0.0]))
    shifted_b, steps = _synthetic([1.0, 1.2, 1.1], [0.0, 0.0, 0.0])
    shifted_b.loc[shifted_b["rank"] == 2, ["t_start", "t_end"]] += 123.0  # a clock with another origin
    assert rank_waits(shifted_b, steps)["wait_s"].tolist() == pytest.approx(same["wait_s"].tolist())


def test_sync_step_model_refuses_nonsense():
    with pytest.raises(ValueError, match="at least one rank"):
        sync_step_model([])
    with pytest.raises(ValueError, match=">= 0 s"):
        sync_step_model({0: 1.0, 1: -0.1})


def test_figures_say_who_waited_for_whom():
    w = rank_waits(*_synthetic([1.0, 1.2, 1.1], [0.0, 0.0, 0.0]))
    fig = who_waited(w, "three ranks")
    assert [t.name for t in fig.data] == ["compute", "injected delay", "waiting for the slowest peer"]
    notes = [a.text for a in fig.layout.annotations]
    assert any("rank 0 waited 200 ms for rank 1 (model 200 ms)" in n for n in notes), notes
    assert any("rank 1 waited for nobody" in n for n in notes)
    assert "Who waited for whom (three ranks)" in fig.layout.title.text
    assert len(wait_per_step(w).data) == 3  # no delay injected: one wait line per rank
    assert "no recorded bucket waits" in who_waited(rank_waits(pd.DataFrame(), None)).layout.title.text
