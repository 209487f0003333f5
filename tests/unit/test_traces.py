"""dtlab.load_trace on Kineto traces: synthetic ones whose answers are known, hand-made ones for the breakdown and
HTA's overlap, damaged files, and the two public traces shipped with dtlab (the overlap figures HTA 0.5.0 printed
for them are the reference: benchmarks/trace_load.py measures them again beside HTA)."""

import gzip
import json

import numpy as np
import pytest

from dtlab.model.link import Link
from dtlab.results.kineto import TraceDamaged, load_trace, public_trace
from dtlab.results.kineto.synthetic import write_synthetic

ALPHA, BETA = 35e-6, 1 / 40e9  # not the generator's default link: the fit must give back the link given
SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)


@pytest.mark.parametrize("layout,prefix,int_ts", [("new", "ncclDevKernel", False), ("old", "ncclKernel", True)])
def test_fit_recovers_known_alpha_beta_from_every_rank(tmp_path, layout, prefix, int_ts):
    """Ranks arrive up to 2 ms apart and their clocks are off by up to 1.7 s: matched and aligned, the transfer
    priced from the last arrival gives back alpha and beta; one rank's kernels alone would not (they hold the
    wait)."""
    write_synthetic(
        tmp_path,
        nproc=4,
        sizes=SIZES,
        link=Link(alpha=ALPHA, beta=BETA),
        delays=[0, 1e-3, 3e-4, 2e-3],
        offsets=[0, 0.5, -0.2, 1.7],
        layout=layout,
        prefix=prefix,
        int_ts=int_ts,
    )
    fit = load_trace(str(tmp_path)).fit()
    f = fit.fits["all_reduce"]
    assert f.alpha == pytest.approx(ALPHA, rel=0.02) and f.beta == pytest.approx(BETA, rel=0.01)
    assert fit.matched == 3 * len(SIZES) and not fit.refused
    offsets = fit.offsets_s
    assert offsets[3] - offsets[0] == pytest.approx(1.7, abs=1e-6)  # the clocks were aligned
    waits = load_trace(str(tmp_path)).waits()
    assert set(waits["last_rank"]) == {3} and set(waits["first_rank"]) == {0}
    assert waits["skew_s"].to_numpy() == pytest.approx(2e-3, abs=2e-6)


def test_old_layout_takes_op_and_bytes_from_the_annotation(tmp_path):
    """SendRecv kernels do not say the collective: the nccl:all_reduce annotation around the launch does."""
    write_synthetic(tmp_path, nproc=2, steps=2, sizes=(1000, 4096), layout="old", prefix="ncclKernel", int_ts=True)
    t = load_trace(str(tmp_path))
    c = t.collectives
    assert list(c["op"].unique()) == ["all_reduce"] and set(c["source"]) == {"cpu annotation"}
    assert sorted(c[c["rank"] == 0]["nbytes"]) == [1000, 1000, 4096, 4096]
    assert c["kernel"].str.startswith("ncclKernel_SendRecv").all()
    assert sorted(t.breakdown()["step"].unique()) == [0, 1]


def test_fit_refuses_what_the_trace_cannot_support(tmp_path):
    write_synthetic(tmp_path / "two", nproc=2, sizes=(1 << 20, 2 << 20))
    fit = load_trace(str(tmp_path / "two")).fit()
    assert "only 2 message size(s)" in fit.refused["all_reduce"] and not fit.fits
    assert "spread of the durations instead" in fit.text() and len(fit.spread) == 2
    one = load_trace(str(tmp_path / "two" / "rank0.json")).fit()
    assert "one rank's trace" in one.refused["*"] and "median" in one.text()
    write_synthetic(tmp_path / "four", nproc=4, sizes=SIZES)
    (tmp_path / "four" / "rank2.json").unlink()
    assert "ranks [2] of the job are missing" in load_trace(str(tmp_path / "four")).fit().refused["*"]


def test_a_trace_without_rank_information_says_so(tmp_path):
    write_synthetic(tmp_path, nproc=2, sizes=SIZES, rank_info=False)
    t = load_trace(str(tmp_path))
    assert [r.rank for r in t.ranks] == [-2, -1] and all("no rank information" in n for n in t.notes)
    assert "no rank information" in t.fit().refused["*"]


def test_damaged_and_truncated_files_are_refused_naming_file_and_position(tmp_path):
    (path,) = write_synthetic(tmp_path / "ok", nproc=1, sizes=SIZES)
    text = open(path).read()  # noqa: SIM115
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) // 2])
    with pytest.raises(TraceDamaged, match=r"cut\.json: truncated at character [\d,]+ \(line \d+\)"):
        load_trace(str(cut))
    bad = tmp_path / "bad.json"
    i = text.index('"ph"', len(text) // 3)
    bad.write_text(text[:i] + "}{" + text[i:])
    with pytest.raises(TraceDamaged, match=rf"bad\.json: not valid JSON .* at character {i + 1:,} "):
        load_trace(str(bad))
    gz = tmp_path / "cut.json.gz"
    packed = gzip.compress(text.encode())
    gz.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(TraceDamaged, match=r"cut\.json\.gz: .*(cut|truncated)"):
        load_trace(str(gz))


def _hand_made(path, cpu=False):
    """One rank, two steps of 10 ms: step 0 computes 0-4 ms and 5-8 ms and communicates 3-7 ms (3 ms hidden),
    step 1 computes 10-12 ms and communicates 12-15 ms (nothing hidden)."""
    ev = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": f"ProfilerStep#{s}",
            "pid": 1,
            "tid": 1,
            "ts": s * 10000 - 500,
            "dur": 10000,
            "args": {},
        }
        for s in (0, 1)
    ]
    spans = [
        (0, 4000, "gemm", 1),
        (5000, 3000, "gemm", 2),
        (3000, 4000, "nccl", 3),
        (10000, 2000, "gemm", 4),
        (12000, 3000, "nccl", 5),
        (8500, 500, "Memcpy DtoD (Device -> Device)", 6),
    ]
    for ts, dur, what, corr in spans:
        ev.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 1,
                "tid": 1,
                "ts": ts - 1,
                "dur": 1,
                "args": {"correlation": corr},
            }
        )
        if cpu and what == "nccl":
            ev.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": "gloo:all_reduce",
                    "pid": 1,
                    "tid": 9,
                    "ts": ts,
                    "dur": dur,
                    "args": {"Input Dims": [[1024]], "Input type": ["float"]},
                }
            )
        elif cpu and what == "gemm":
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": ts, "dur": dur})
        elif not cpu:
            name = (
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"
                if what == "nccl"
                else what
                if what.startswith("Memcpy")
                else "sm90_xmma_gemm"
            )
            ev.append(
                {
                    "ph": "X",
                    "cat": "gpu_memcpy" if what.startswith("Memcpy") else "kernel",
                    "name": name,
                    "pid": 0,
                    "tid": 7,
                    "ts": ts,
                    "dur": dur,
                    "args": {"stream": 7, "correlation": corr},
                }
            )
    path.write_text(json.dumps({"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": ev}))
    return str(path)


@pytest.mark.parametrize("cpu", [False, True])
def test_breakdown_per_step_is_unions_of_intervals(tmp_path, cpu):
    b = load_trace(_hand_made(tmp_path / "t.json", cpu=cpu)).breakdown().set_index("step")
    assert list(b.index) == [0, 1]

    def ms(col):
        return list(np.round(b[col].to_numpy() * 1e3, 6))

    assert ms("T_step") == [10, 10] and ms("T_comp") == [7, 2] and ms("T_comm") == [4, 3]
    assert ms("exposed") == [1, 3] and list(b["overlap"].round(6)) == [0.75, 0.0]


def test_overlap_in_htas_definition_leaves_out_the_last_step(tmp_path):
    """Whole trace: 3 of 7 ms of communication hidden; HTA's rule keeps only what was launched before the last
    ProfilerStep started (step 0: 3 of 4 ms)."""
    t = load_trace(_hand_made(tmp_path / "t.json"))
    assert t.overlap()["overlap_pct"].iloc[0] == pytest.approx(75.0)
    assert t.overlap(last_step=True)["overlap_pct"].iloc[0] == pytest.approx(100 * 3 / 7)


def test_gloo_collectives_are_cpu_spans(tmp_path):
    c = load_trace(_hand_made(tmp_path / "t.json", cpu=True)).collectives
    assert list(c["source"]) == ["cpu op (gloo)"] * 2 and list(c["nbytes"]) == [4096, 4096]
    assert list(c["step"]) == [0, 1] and (c["stream"] == -1).all()


#: comm_comp_overlap_pctg printed by HTA 0.5.0's get_comm_comp_overlap() on the same files
HTA_OVERLAP = {"hta-2ranks-rank0": 14.31, "hta-8ranks-rank3": 47.03}


@pytest.mark.parametrize("name", sorted(HTA_OVERLAP))
def test_public_traces_agree_with_hta_and_give_every_step_and_all_reduce(name):
    t = load_trace(public_trace(name))
    assert abs(t.overlap()["overlap_pct"].iloc[0] - HTA_OVERLAP[name]) < 1.0
    b, c = t.breakdown(), t.collectives
    ar = c[c["op"] == "all_reduce"]
    if name == "hta-2ranks-rank0":
        assert list(b["step"]) == [4, 5, 6] and set(c["source"]) == {"kernel args"}
        assert sorted(ar["nbytes"].unique()) == [8196000, 9724160, 26255360, 26550272, 31502336]
    else:
        assert list(b["step"]) == list(range(1009, 1015)) and set(c["source"]) == {"cpu annotation"}
        assert sorted(ar["nbytes"].unique()) == [1068160, 17728292, 181240752] and len(ar) == 18
    assert ar["nbytes"].notna().all() and (b["T_comm"] > 0).all()


def test_a_window_that_cuts_any_value_reads_the_same(tmp_path, monkeypatch):
    """The reader slides a window over the text: wherever the window's end falls (inside a number after its '.' or
    'e', inside 'true' or 'null', a string, between events), the columns are those of one read in a single window."""
    from dtlab.results.kineto import reader

    (path,) = write_synthetic(tmp_path / "w", nproc=1, sizes=SIZES[:2], int_ts=False)
    data = json.loads(open(path).read())  # noqa: SIM115
    for i, e in enumerate(data["traceEvents"]):  # values of every JSON kind, some cut by a small window
        e.setdefault("args", {}).update(flag=i % 2 == 0, none=None, big=1.5e-7 * (i + 1), neg=-i)
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(data))
    want = reader.read_columns(str(whole))
    for chunk in (7, 13, 64):
        monkeypatch.setattr(reader, "CHUNK", chunk)
        got = reader.read_columns(str(whole))
        assert (got.n_events, got.dev_ts, got.dev_dur, got.rt_ts, got.steps) == (
            want.n_events,
            want.dev_ts,
            want.dev_dur,
            want.rt_ts,
            want.steps,
        ), chunk
