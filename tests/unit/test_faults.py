"""Fault drills on the tiny model with 2 gloo ranks: the rank that caused a failure is named (not the survivor
that lost its peer), a frozen rank is caught by the watchdog in seconds with its stack in its log, an
interrupt stops every rank within 5 s, launches started together never share a port or a directory, bad
input never starts anything, and no rank PID outlives the call that reported the failure.

Faults are injected with DTLAB_FAULT="RANK:STEP:MODE" (dtlab.rank.lifecycle.maybe_inject_fault): the rank hurts
itself at the start of that step, which is deterministic where racing a `kill` from the test is not."""

import re

import pytest

import dtlab
from dtlab.cli.main import main as cli_main


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda p: dict(data=_csv(p, "text,label\nfine film,1\n")), "lacks column(s) sentence"),
        (
            lambda p: dict(data=_csv(p, "sentence,label\nfine film,1\nbad film,7\n")),
            "row 2: label must be the number 0 or 1",
        ),
        (lambda p: dict(data=_csv(p, "sentence,label\nfine film,pos\n")), "row 1: label must be the number 0 or 1"),
        (lambda p: dict(data=_csv(p, "sentence,label\n")), "has no rows"),
        (lambda p: dict(data=_csv(p, "sentence,label\n" + "fine film,1\n" * 7)), "has 7 row(s); a run needs at least"),
        (lambda p: dict(bucket_mb=float("inf")), "bucket_mb must be a finite number"),
        (lambda p: dict(lr=float("nan")), "lr must be a finite number"),
        (lambda p: dict(stall_s=-1.0), "stall_s must be a finite number > 0"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(tmp_path, make, needle):
    out = tmp_path / "never"
    with pytest.raises(ValueError) as info:
        dtlab.launch(dtlab.tiny(out=str(out), **make(tmp_path)))
    assert needle in str(info.value)
    assert not out.exists()  # no run directory, no events, no process


def test_unknown_keys_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown zero field.*bogus"):
        dtlab.tiny(zero={"bogus": 1})
    with pytest.raises(ValueError, match="unknown RunConfig field.*bogus"):
        dtlab.RunConfig.from_dict({**dtlab.tiny().to_dict(), "bogus": 1})


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--bucket-mb", "inf"], r"bucket[-_]mb.*finite number"),  # by the parser (the flag) or validation
        (["--stall", "0"], "stall_s must be"),
        (["--data", "BAD"], "row 2: label must be the number 0 or 1"),
    ],
)
def test_cli_refuses_bad_input_with_exit_2(tmp_path, capsys, args, needle):
    bad = _csv(tmp_path, "sentence,label\nfine film,1\nbad film,7\n")
    args = [bad if a == "BAD" else a for a in args]
    try:
        rc = cli_main(["run", "--model", "tiny", "--out", str(tmp_path / "x"), *args])
    except SystemExit as e:  # refused by the argument parser itself
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and re.search(needle, err), err
    assert not (tmp_path / "x").exists()


def _csv(tmp_path, text):
    p = tmp_path / "data.csv"
    p.write_text(text)
    return str(p)


def test_a_failure_after_a_baseline_step_names_the_training_step_it_followed():
    """Baseline steps run right after the training step they are paired with and are numbered after the training
    steps: "after baseline step 6" alone would hide that the rank had finished training step 1."""
    from dtlab.launching.failures import progress_of

    ev = [{"kind": "step", "step": 1}, {"kind": "baseline_step", "step": 6, "paired_step": 1}]
    assert progress_of(ev) == "after step 1 and its baseline step 6"
    assert progress_of(ev[:1]) == "after step 1"
    assert progress_of([{"kind": "baseline_step", "step": 6}]) == "after baseline step 6"  # unpaired (older runs)


def test_a_tiny_run_silent_before_its_first_step_is_a_stall_long_before_its_timeout():
    from dtlab.launching.handle import TINY_STARTUP_S, Handle
    from dtlab.launching.watchdog import STARTUP_ALLOWANCE_S

    h = Handle.__new__(Handle)  # the watchdog's rule alone, no launch
    h.stall_s, h._feeds, h.startup_s = None, [], TINY_STARTUP_S
    assert h.stall_threshold(stepping=False) == TINY_STARTUP_S < dtlab.tiny().timeout_s
    h.stall_s = 200.0  # a longer stall_s still wins
    assert h.stall_threshold(stepping=False) == 200.0 and h.stall_threshold(stepping=True) == 200.0
    h.stall_s, h.startup_s = None, None  # another model: imports, a download, DeepSpeed's setup
    assert h.stall_threshold(stepping=False) == STARTUP_ALLOWANCE_S
