"""What the labs say, checked without running a lab: the passages each placement gets (dtlab.course.wording), the
screen checks the notebook tests apply to every executed lab (dtlab.course.screen), claims about time that need
three repeats, the bucket timeline's wait, and a check whose run failed."""

import types

import pandas as pd
import pytest

from dtlab.config.placement import plan
from dtlab.config.run import RunConfig
from dtlab.course import wording
from dtlab.course.claims import MIN_TIME_REPEATS, compare, consistent
from dtlab.course.screen import doubled_words, keys_before_questions, renderings, rounded_away

CPU = plan(2, ngpu=0)
HOST_STAGED = plan(2, ngpu=1, nccl_version="2.28.9")  # one GPU, NCCL too old to share it: gloo on CUDA tensors
NCCL_SHARED = plan(2, ngpu=1, nccl_version="2.30.0")
NCCL = plan(2, ngpu=2)
GPUS = (HOST_STAGED, NCCL_SHARED, NCCL)
#: words that only make sense on a CPU machine, and on a GPU machine
CPU_WORDS = ("CPU", "cores", "laptop")
GPU_WORDS = ("your ranks share one GPU", "this GPU", "ranks share one GPU", "NCCL's kernels", "on the GPU")


def test_placements_are_told_apart():
    assert [wording.kind(p) for p in (CPU, HOST_STAGED, NCCL_SHARED, NCCL)] == list(wording.KINDS)
    assert wording.kind(HOST_STAGED.to_dict()) == "host_staged"  # as a run records it


@pytest.mark.parametrize("key", sorted(wording.TEXTS))
def test_a_gpu_placement_reads_no_cpu_sentence(key):
    for placement in GPUS:
        text = wording.text(key, placement)
        assert text and "{" not in text, (key, text)
        assert not [w for w in CPU_WORDS if w in text], (key, wording.kind(placement), text)


@pytest.mark.parametrize("key", sorted(wording.TEXTS))
def test_a_cpu_placement_reads_no_gpu_sentence(key):
    text = wording.text(key, CPU)
    assert text and "{" not in text, (key, text)
    assert not [w for w in GPU_WORDS if w in text], (key, text)


def test_lab01_question_3_follows_the_machine():
    assert "cores" in wording.text("lab01.questions", CPU)
    staged = wording.text("lab01.questions", HOST_STAGED)
    assert "host memory" in staged and "2 ranks share one GPU" in staged
    assert "streaming multiprocessors" in wording.text("lab01.questions", NCCL)
    assert "CPU numbers" in wording.text("lab03.exercises", CPU)
    assert "NVLink" in wording.text("lab03.exercises", HOST_STAGED)


def test_unknown_passage_is_named():
    with pytest.raises(KeyError, match="known"):
        wording.text("lab99.nothing", CPU)


def _ddp_run(sizes, nproc=2):
    buckets = pd.DataFrame(
        {
            "rank": 0,
            "step": 3,
            "bucket": range(len(sizes)),
            "nbytes": sizes,
            "wire_bytes": sizes,
            "t_ready": [0.001 * (i + 1) for i in range(len(sizes))],
            "t_start": [0.001 * (i + 1) for i in range(len(sizes))],
            "t_end": [0.001 * (i + 1.5) for i in range(len(sizes))],
        }
    )
    return types.SimpleNamespace(buckets=buckets, nproc=nproc, warmup=1)


def test_nccl_estimate_prices_each_bucket_with_the_ring_form():
    from dtlab.model.costmodel import ring_allreduce

    run = _ddp_run([1_000_000, 3_000_000])
    est = wording.nccl_estimate(run)
    for link, ref in wording.NCCL_REFERENCE.items():
        want = sum(ring_allreduce(ref["alpha_s"], 1 / ref["busbw"], n, 2) for n in (1e6, 3e6))
        assert est[link] == pytest.approx(want)
    assert est["NVLink"] < est["PCIe"]
    assert wording.nccl_estimate(types.SimpleNamespace(buckets=pd.DataFrame(), nproc=2, warmup=0)) == {}


# ---- the screen checks -------------------------------------------------------------------------------------


def test_rounded_away_values_are_found():
    assert rounded_away("   nproc  bucket (MiB) status\n0  2  0.0  ran") == ["0  2  0.0  ran"]
    assert rounded_away("overlap -0.0") and rounded_away("exposed 0.00 ms")
    # an exact zero printed as 0, real values, an interval clipped at 0, and a version number are fine
    assert not rounded_away("bucket 0.05 MiB, wait 0 ms, 10.0 ms, overlap [0.00, 0.91], torch 2.0.1, 0.01")


def test_doubled_words_are_found():
    assert doubled_words("(tolerance the tolerance; exact byte counts)") == ["tolerance the tolerance"]
    assert doubled_words("it is the the run") == ["the the"]
    assert not doubled_words("from step to step; none      none (a table); bye-bye")


def test_a_key_printed_before_its_question_is_found():
    def cell(src, out=""):
        return {
            "cell_type": "code",
            "source": src,
            "outputs": [{"output_type": "stream", "name": "stdout", "text": out}] if out else [],
        }

    nb = {
        "cells": [
            cell("print(table)", "baseline  40  0.440\n"),
            cell("my_time = None"),
            cell("check('lab09.q5', my_time)", "0.440 s"),
        ]
    }
    assert keys_before_questions(nb, {"my_time": 0.44}) and not keys_before_questions(nb, {"my_time": 0.45})
    assert not keys_before_questions({"cells": nb["cells"][1:]}, {"my_time": 0.44})  # printed after: fine
    assert "4,045,448" in renderings(4045448) and "0.440" in renderings(0.44) and "0.44" not in renderings(0.44)


# ---- claims about time, waits, failed sections -------------------------------------------------------------


def test_a_claim_about_time_needs_three_repeats():
    one = compare("x.t", "a is faster", "T", ("a", [1.0]), ("b", [2.0]), expected=0.5, model="m")
    assert one.outcome == "inconclusive" and "at least 3" in one.why and "holds" in one.why
    assert not consistent(one.record())
    three = compare("x.t", "a is faster", "T", ("a", [1.0, 1.1, 0.9]), ("b", [2.0, 2.1, 1.9]), expected=0.5, model="m")
    assert three.outcome == "holds" and three.min_n == MIN_TIME_REPEATS
    rec = three.record()
    rec["ratios"]["n"] = 2  # a record that decides from 2 repeats is caught
    assert consistent(rec)
    exact = compare(
        "x.b", "bytes halve", "B", ("a", [1.0]), ("b", [2.0]), expected=0.5, model="m", unit="B", rel_tol=0.01
    )
    assert exact.outcome == "holds"  # a byte count is exact: one run decides


def test_a_hidden_tolerance_is_not_said_twice():
    from dtlab.course.verdicts import Key, judge_number

    rec = judge_number(
        Key("lab04.q3", "number", 100.0, rel_tol=0.1, tol_source="the model's error", show_tol=False), None
    )
    assert not doubled_words(rec["verdict"]) and "the model's error" in rec["verdict"]


def test_the_timeline_draws_the_end_of_backward_as_a_wait():
    from dtlab.viz.figures import bucket_timeline

    steps = pd.DataFrame({"rank": [0], "step": [3], "t_fwd": [0.003], "t_bwd": [0.010], "t_opt": [0.001]})
    buckets = pd.DataFrame(
        {
            "rank": 0,
            "step": 3,
            "bucket": [0, 1, 2],
            "nbytes": [55688, 82944, 3906816],
            "t_ready": [0.005, 0.006, 0.007],
            "t_start": [0.005, 0.006, 0.007],
            "t_end": [0.008, 0.010, 0.0125],
        }
    )
    fig = bucket_timeline(types.SimpleNamespace(steps=steps, buckets=buckets, collectives=pd.DataFrame()))
    bars = {t.name: (t.base[0], t.x[0]) for t in fig.data if t.type == "bar" and t.y[0] == "compute"}
    assert bars["backward"] == pytest.approx((3.0, 4.0))  # to the last ready mark
    assert bars["waiting for all-reduces"] == pytest.approx((7.0, 6.0))  # to the end of backward
    labels = [t for t in fig.data if t.name == "all-reduce"][0].y
    assert labels[0] == "bucket 0 (0.0531 MiB)"  # not a rounded 0.1 MiB under a 0.05 MiB cap


def test_a_check_whose_run_failed_says_so(capsys):
    from dtlab.course.checks import check

    assert check("lab10.q1", 4, runs=None) is None
    assert "not checked: runs is missing" in capsys.readouterr().out


def test_attempt_turns_a_failed_run_into_a_message(capsys):
    from dtlab.course.labs import attempt

    def boom():
        raise RuntimeError("rank 1 failed: mixed Tensor and DTensor\nmore")

    assert attempt("the tensor-parallel run", boom, needed_by="question 1") is None
    out = capsys.readouterr().out
    assert "the tensor-parallel run failed: RuntimeError: rank 1 failed" in out and "(question 1)" in out
    assert attempt("x", lambda: 5) == 5


def test_powersgd_encode_leaves_out_the_step_that_builds_its_state():
    from dtlab.model.compression import compression_from_run

    rows = []
    for step, (wire, encode) in enumerate([(100, 0.0), (100, 0.0), (10, 0.040), (10, 0.002), (10, 0.002)]):
        rows.append(
            {
                "rank": 0,
                "step": step,
                "bucket": 0,
                "nbytes": 100,
                "wire_bytes": wire,
                "t_ready": 0.0,
                "t_start": encode,
                "t_end": encode + 0.001,
            }
        )
    run = types.SimpleNamespace(
        buckets=pd.DataFrame(rows),
        warmup=1,
        path="fake",
        config=RunConfig(compression={"hook": "powersgd", "powersgd_start_iter": 2}),
    )
    comp = compression_from_run(run)
    assert comp["encode_s"] == pytest.approx(0.002) and comp["ratio"] == pytest.approx(0.1)
