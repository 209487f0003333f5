"""nccl-tests output read into a Profile: every shipped output, every format variant, damaged output refused by
line, the collective told from the rows (or refused when it contradicts op=)."""

import re

import numpy as np
import pytest

import dtlab
from dtlab.model import costmodel as cm
from dtlab.model.profile import Profile
from dtlab.results.nccl_tests import NcclTestsDamaged, parse_nccl_tests

# name -> (rows, op, ranks, nodes, GPU model or None): facts of the shipped files (dtlab/results/nccl-tests/)
SHIPPED = {
    "gcp-a3mega-h100-2x8-tcpxo": (31, "all_reduce", 16, 2, "NVIDIA H100 80GB HBM3"),
    "cscs-alps-gh200-2x4-slingshot": (25, "all_reduce", 8, 2, "NVIDIA GH200 120GB"),
    "cscs-alps-gh200-2x4-tcp": (25, "all_reduce", 8, 2, "NVIDIA GH200 120GB"),
    "cscs-alps-gh200-2x1-slingshot": (8, "all_reduce", 2, 2, "NVIDIA GH200 120GB"),
    "aws-p5-1x8-h100-nvswitch": (32, "all_reduce", 8, 1, None),
    "aws-p4de-2x8-a100-efa": (29, "all_reduce", 16, 2, None),
    "aws-p5-2x8-h100-efa": (29, "all_reduce", 16, 2, None),
    "rtx4090-pcie-1x2": (29, "all_reduce", 2, 1, "NVIDIA GeForce RTX 4090"),
    "rtx4090-pcie-1x4": (29, "all_reduce", 4, 1, "NVIDIA GeForce RTX 4090"),
    "sheffield-v100-pcie-1x4": (25, "all_reduce", 4, 1, "Tesla V100-PCIE-32GB"),
    "sheffield-a100-sxm4-1x4": (25, "all_reduce", 4, 1, "NVIDIA A100-SXM4-80GB"),
    "h100-ib-ndr-2x8": (14, "all_reduce", 16, 2, "NVIDIA H100 80GB HBM3"),
    "h100-ib-ndr-4x8": (14, "all_reduce", 32, 4, "NVIDIA H100 80GB HBM3"),
    "h100-ib-ndr-8x8": (14, "all_reduce", 64, 8, "NVIDIA H100 80GB HBM3"),
    "h100-ib-ndr-8x8-tuned": (14, "all_reduce", 64, 8, "NVIDIA H100 80GB HBM3"),
    "h100-ib-ndr-2x8-ring-tuned": (14, "all_reduce", 16, 2, "NVIDIA H100 80GB HBM3"),
    "dell-xe9680-2x8-h100-ib": (32, "all_reduce", 16, 2, "NVIDIA H100 80GB HBM3"),
    "dell-xe9680-4x8-h100-ib": (32, "all_reduce", 32, 4, "NVIDIA H100 80GB HBM3"),
    "oci-gb200-32x4-nvl72-roce": (33, "all_reduce", 128, 32, "NVIDIA GB200"),
    "gcp-a4xmax-2x4-gb300-rdma": (23, "all_gather", 8, 2, "NVIDIA GB300"),
}
#: outputs whose posted device lines list only some ranks: their node count comes from sources.json
CUT_LISTING = {"oci-gb200-32x4-nvl72-roce"}


def test_every_shipped_output_is_listed_with_its_provenance():
    listing = dtlab.public_nccl_tests()
    assert sorted(listing["name"]) == sorted(SHIPPED)
    for row in listing.itertuples():
        assert row.source.startswith("https://") and row.licence and row.posted and row.system


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_output_reads_whole(name):
    n_rows, op, ranks, nodes, gpu = SHIPPED[name]
    path = dtlab.public_nccl_tests().set_index("name").loc[name, "path"]
    table = parse_nccl_tests(path, nodes=None if gpu and name not in CUT_LISTING else nodes)
    assert (len(table.rows), table.op, table.nproc, table.nodes) == (n_rows, op, ranks, nodes)
    assert table.gpu_models == ([gpu] if gpu else [])
    prof = dtlab.public_nccl_tests(name)
    assert isinstance(prof, Profile)
    # one sample per size and column, each the row's time: nothing dropped, nothing invented
    assert len(prof.samples) == 2 * n_rows
    assert np.allclose(prof.samples.groupby("nbytes")["seconds"].count(), 2)
    assert prof.meta["world_size"] == ranks and prof.meta["nnodes"] == nodes
    assert prof.meta["source"]["system"]["source"].startswith("https://")
    segs = prof.segments[op]
    assert segs[0].min_bytes == table.rows["size"].min() and segs[-1].max_bytes == table.rows["size"].max()
    assert all(s.alpha >= 0 and s.beta >= 0 for s in segs)


def table(op="all_reduce", p=8, sizes=None, alpha=5e-6, beta=1 / 100e9, style="new", redop="sum", dtype="float"):
    """nccl-tests output of a known alpha-beta ring collective, formatted as nccl-tests prints it."""
    sizes = sizes or [2**k for k in range(10, 25)]
    tb = {"float": 4, "half": 2}[dtype]
    lines = [
        f"# nThread 1 nGpus {p} minBytes {sizes[0]} maxBytes {sizes[-1]} step: 2(factor) warmup iters: 5 iters: 20",
        "#",
        "# Using devices",
        *(
            f"#  Rank {r:2d} Group  0 Pid   100 on nodeA device {r:2d} [0x{r:02x}] NVIDIA H100 80GB HBM3"
            for r in range(p)
        ),
        "#",
    ]
    root = "    root" if style == "new" else ""
    check = " #wrong" if style == "new" else "  error"
    red = "   redop" if redop else ""
    perf_head = f"     time   algbw   busbw{check}"
    lines.append(f"#       size         count      type{red}{root}{perf_head}{perf_head}")
    factor = {"all_reduce": 2 * (p - 1) / p}.get(op, (p - 1) / p)
    for n in sizes:
        t = cm.collective_time(op, "ring", alpha, beta, n, p) * 1e6
        count = n // tb if op == "all_reduce" else n // tb // p
        algbw = n / t / 1e3
        cells = f"{n:12d}  {count:12d}  {dtype:>8}"
        if redop:
            cells += f"  {redop:>6}"
        if style == "new":
            cells += "      -1"
        w = "      0" if style == "new" else "  2e-07"
        perf = f"  {t:7.2f}  {algbw:6.2f}  {algbw * factor:6.2f}{w}"
        lines.append(cells + perf + perf)
    lines += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 12.5", "#"]
    return "\n".join(lines) + "\n"


def test_the_newest_format_with_its_version_and_named_collective():
    text = "# nccl-tests version 2.18.2 nccl-headers=23007 nccl-library=23007\n"
    text += "# Collective test starting: all_reduce_perf\n" + table()
    t = parse_nccl_tests(text)
    assert t.op == "all_reduce" and t.op_from == "named by the output"
    assert t.versions["nccl-tests"] == "2.18.2" and t.versions["nccl"] == "23007"
    assert (t.nproc, t.nodes, t.avg_busbw) == (8, 1, 12.5)


def test_old_error_columns_and_the_avg_reduction():
    t = parse_nccl_tests(table(style="old", redop="avg"))
    assert t.op == "all_reduce" and len(t.rows) == 15 and t.rows["check"].iloc[0] == "2e-07"


@pytest.mark.parametrize("prefix", ["[1,0]<stdout>:", "0: ", "[1,0]:"])
def test_launcher_prefixes_and_interleaved_nccl_lines(prefix):
    lines = table().splitlines()
    lines.insert(12, "node1:880:880 [1] NCCL INFO comm 0x55ba rank 0 nranks 8 - Destroy COMPLETE")
    t = parse_nccl_tests("\n".join(prefix + x for x in lines) + "\n")
    assert len(t.rows) == 15 and t.skipped_lines == 1 and t.nproc == 8


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_per_rank_counts_tell_all_gather_and_reduce_scatter(op):
    t = parse_nccl_tests(table(op=op, p=4, redop="none" if op == "all_gather" else "sum"))
    assert t.op == op and t.nproc == 4 and "rows" in t.op_from
    prof = dtlab.load_nccl_tests(table(op=op, p=4, redop="none" if op == "all_gather" else "sum"))
    assert list(prof.fits) == [op]
    assert prof.fits[op].alpha == pytest.approx(5e-6, rel=0.05)
    assert 1 / prof.fits[op].beta == pytest.approx(100e9, rel=0.02)


def test_the_oldest_all_gather_has_no_redop_column():
    t = parse_nccl_tests(table(op="all_gather", p=4, redop=None, style="old"))
    assert t.op == "all_gather" and "no redop column" in t.op_from


def test_rank_count_from_busbw_when_no_device_lines():
    text = "\n".join(x for x in table(p=16).splitlines() if "Rank" not in x and "nThread" not in x) + "\n"
    t = parse_nccl_tests(text)
    assert t.nproc == 16 and "busbw / algbw" in t.nproc_from and t.nodes is None
    assert parse_nccl_tests(text, nodes=2).nodes == 2


def test_op_contradicting_the_rows_is_refused():
    with pytest.raises(ValueError, match=r"op= says 'all_gather', but the rows say 'all_reduce'"):
        parse_nccl_tests(table(), op="all_gather")
    named = "# Collective test starting: reduce_scatter_perf\n" + table()
    with pytest.raises(ValueError, match="'Collective test' line says 'reduce_scatter'"):
        parse_nccl_tests(named)
    with pytest.raises(ValueError, match="op must be one of"):
        parse_nccl_tests(table(), op="allreduce")


def test_a_wrong_rank_count_is_refused():
    with pytest.raises(ValueError, match="nproc=4 contradicts the device lines"):
        parse_nccl_tests(table(), nproc=4)


def _line_of(text, needle):
    return next(i for i, x in enumerate(text.splitlines(), start=1) if needle in x)


def test_a_row_cut_mid_line_is_refused_naming_its_line():
    text = table()
    at = _line_of(text, "  65536  ")
    lines = text.splitlines()
    cut = "\n".join(lines[: at - 1] + [lines[at - 1][:40]])
    with pytest.raises(NcclTestsDamaged, match=rf"line {at}: .* fields where the table has 13") as err:
        parse_nccl_tests(cut + "\n")
    assert err.value.line == at


def test_an_output_cut_between_rows_is_refused():
    lines = table().splitlines()
    with pytest.raises(NcclTestsDamaged, match="without its footer") as err:
        parse_nccl_tests("\n".join(lines[:-6]) + "\n")
    assert err.value.line == len(lines) - 6


def test_missing_rows_against_the_header_are_refused():
    lines = [x for x in table().splitlines() if not re.match(r"\s+16777216 ", x)]
    with pytest.raises(NcclTestsDamaged, match="asked for sizes up to 16,777,216 B: rows are missing"):
        parse_nccl_tests("\n".join(lines) + "\n")


def test_a_damaged_number_is_refused_naming_its_line():
    text = table()
    at = _line_of(text, "  1048576  ")
    lines = text.splitlines()
    fields = lines[at - 1].split()
    fields[6] = str(float(fields[6]) * 3)  # algbw no longer size / time
    lines[at - 1] = "  ".join(fields)
    with pytest.raises(NcclTestsDamaged, match=rf"line {at}: algbw .* is not size / time"):
        parse_nccl_tests("\n".join(lines) + "\n")
    lines[at - 1] = lines[at - 1].replace("float", "flaot")
    with pytest.raises(NcclTestsDamaged, match=rf"line {at}: unknown type 'flaot'"):
        parse_nccl_tests("\n".join(lines) + "\n")


def test_sizes_out_of_order_and_two_tables_are_refused():
    text = table()
    lines = text.splitlines()
    a, b = _line_of(text, "  65536  "), _line_of(text, "  131072  ")
    lines[a - 1], lines[b - 1] = lines[b - 1], lines[a - 1]
    with pytest.raises(NcclTestsDamaged, match=rf"line {b}: size 65,536 B does not follow 131,072 B"):
        parse_nccl_tests("\n".join(lines) + "\n")
    with pytest.raises(NcclTestsDamaged, match="a second nccl-tests header"):
        parse_nccl_tests(table() + table())


def test_no_table_and_bad_input_are_refused():
    with pytest.raises(NcclTestsDamaged, match="no nccl-tests table rows"):
        parse_nccl_tests("hello\nworld\n")
    with pytest.raises(ValueError, match="is not a file"):
        parse_nccl_tests("/no/such/file.txt")
    with pytest.raises(ValueError, match="nproc must be a positive integer"):
        parse_nccl_tests(table(), nproc=0)


def test_a_busbw_that_is_not_the_ops_factor_is_refused():
    # sendrecv prints redop sum and count = size / 4 like all_reduce, but busbw = algbw: at p = 8 it is refused
    text = table().replace("NVIDIA H100", "NVIDIA H100")
    lines = text.splitlines()
    at = _line_of(text, "  8388608  ")
    f = lines[at - 1].split()
    f[7] = f[6]
    lines[at - 1] = "  ".join(f)
    with pytest.raises(ValueError, match=rf"line {at}: busbw .* is not algbw x 1.7500 \(all_reduce on 8 ranks\)"):
        parse_nccl_tests("\n".join(lines) + "\n")


def _regimes(noise=0.0, seed=0, p=8):
    """Samples of an all-reduce with three known regimes, as NCCL's LL, LL128 and Simple protocols give: the
    breakpoints at 64 KiB and 8 MiB."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    regimes = [(0, 2**16, 2e-6, 1 / 5e9), (2**17, 2**23, 8e-6, 1 / 60e9), (2**24, 2**40, 30e-6, 1 / 300e9)]
    rows = []
    for n in (2**k for k in range(3, 34)):
        a, b = next((a, b) for lo, hi, a, b in regimes if lo <= n <= hi)
        t = cm.collective_time("all_reduce", "ring", a, b, n, p)
        for _place in range(2):
            rows.append({"op": "all_reduce", "nbytes": n, "nproc": p, "seconds": t * (1 + noise * rng.normal())})
    return pd.DataFrame(rows), regimes


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_piecewise_fit_finds_the_known_breakpoints(noise):
    from dtlab.model.fit import fit_piecewise

    samples, regimes = _regimes(noise)
    segs = fit_piecewise(samples, "all_reduce", max_segments=5)
    assert [(s.min_bytes, s.max_bytes) for s in segs] == [(8, 2**16), (2**17, 2**23), (2**24, 2**33)]
    for s, (_, _, a, b) in zip(segs, regimes):
        assert s.alpha == pytest.approx(a, rel=0.1 if noise else 1e-6)
        assert s.beta == pytest.approx(b, rel=0.05 if noise else 1e-6)
        assert s.alpha_ci[0] <= s.alpha <= s.alpha_ci[1] and s.nprocs == [8]
    # one line cannot follow it: the single fit misses by far more than the regimes do
    single = Profile.from_samples(samples).fits["all_reduce"]
    assert single.rel_rms > 5 * max(s.rel_rms for s in segs) + 0.05


def test_piecewise_fit_refuses_bad_settings():
    from dtlab.model.fit import fit_piecewise

    samples, _ = _regimes()
    with pytest.raises(ValueError, match="max_segments must be an integer >= 1"):
        fit_piecewise(samples, "all_reduce", max_segments=0)
    with pytest.raises(ValueError, match="min_points must be an integer >= 3"):
        fit_piecewise(samples, "all_reduce", min_points=2)


def test_a_prediction_outside_what_the_fit_saw_says_so(tmp_path):
    from dtlab.model.profile import OutsideFitWarning
    from dtlab.results.calibration import load_profile

    prof = dtlab.load_nccl_tests(table(p=8))  # 1 KiB .. 16 MiB on 8 ranks, one node
    why = prof.outside("all_reduce", [2**12, 2**30], 8)
    assert why[0] == "" and "1,073,741,824 B (fitted 1,024..16,777,216 B)" in why[1]
    assert "16 processes (fitted at 8)" in prof.outside("all_reduce", 2**20, 16)[0]
    assert "2 node(s) (fitted on 1)" in prof.outside("all_reduce", 2**20, 8, nodes=2)[0]
    with pytest.warns(OutsideFitWarning, match="extrapolated, not measured"):
        prof.predict("all_reduce", [2**20, 2**30], 8, warn=True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prof.predict("all_reduce", [2**12, 2**20], 8, warn=True)  # inside: silent
    prof.save(tmp_path)
    assert load_profile(tmp_path).fit_range("all_reduce")["nprocs"] == [8]


def test_predict_flags_steps_priced_outside_the_fit():
    run = dtlab.recorded_run("h200-ddp").run  # 2 ranks, buckets of 27 to 256 MiB
    inside = dtlab.predict(run, dtlab.public_nccl_tests("rtx4090-pcie-1x2"))
    assert (inside["outside_fit"] == "").all() and inside["predicted_t_comm"].gt(0).all()
    other_count = dtlab.predict(run, dtlab.public_nccl_tests("rtx4090-pcie-1x4"))
    assert other_count["outside_fit"].str.contains("2 processes \\(fitted at 4\\)").all()
    two_nodes = dtlab.predict(run, dtlab.public_nccl_tests("cscs-alps-gh200-2x1-slingshot"))
    assert (two_nodes["outside_fit"] == "1 node(s) (fitted on 2)").all()
    zero3 = dtlab.recorded_run("h200-zero3").run  # collectives, not buckets: every op priced, every op checked
    flagged = dtlab.predict(zero3, dtlab.public_nccl_tests("rtx4090-pcie-1x4"))
    assert not flagged.empty and flagged["outside_fit"].str.contains("2 processes (fitted at 4)", regex=False).all()


def test_the_command_prints_the_table_the_fit_and_busbw_against_it(capsys, tmp_path):
    from dtlab.cli.main import main

    assert main(["nccl-tests", "rtx4090-pcie-1x4"]) == 0
    out = capsys.readouterr().out
    assert "all_reduce | 4 ranks on 1 node(s)" in out and "NVIDIA GeForce RTX 4090" in out
    assert "single line" in out and "regime 1" in out and "1/beta" in out and "GB/s" in out
    assert out.count(" KiB ") + out.count(" MiB ") + out.count(" GiB ") >= 20  # a row per size
    assert "https://github.com/kalavai-net/kalavai-client" in out
    lines = table().splitlines()
    (tmp_path / "cut.txt").write_text("\n".join(lines[:-6]) + "\n")
    assert main(["nccl-tests", str(tmp_path / "cut.txt")]) == 2
    assert "without its footer" in capsys.readouterr().err
    assert main(["nccl-tests", "--list"]) == 0 and "aws-p5-2x8-h100-efa" in capsys.readouterr().out


def _cpu_like_profile():
    import pandas as pd

    rows = [
        {
            "op": "all_reduce",
            "nbytes": n,
            "nproc": 2,
            "seconds": cm.collective_time("all_reduce", "ring", 50e-6, 1 / 2e9, n, 2),
        }
        for n in (2**k for k in range(12, 27))
        for _ in range(3)
    ]
    return Profile.from_samples(pd.DataFrame(rows), meta={"world_size": 2, "backend": "gloo"})


def test_the_figure_sets_a_calibration_beside_a_real_curve():
    from dtlab.viz.nccl_tests import nccl_tests_figure

    real = dtlab.public_nccl_tests("aws-p5-1x8-h100-nvswitch")
    fig = nccl_tests_figure(real, _cpu_like_profile())
    assert [t.mode for t in fig.data] == ["markers", "lines", "markers", "lines"]
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert "GB/s" in fig.layout.yaxis.title.text and "bytes" in fig.layout.xaxis.title.text
    # the real box's measured busbw at 16 GiB, as nccl-tests printed it (483.05 and 483.35 GB/s)
    assert fig.data[0].y[-1] == pytest.approx(483.2, rel=2e-3)
    ratio = 2e9 * real.segments["all_reduce"][-1].beta  # yours is 2 GB/s: the ratio of the two 1/beta
    assert f"{1 / ratio:.3g}x yours" in fig.layout.title.text.replace("<br>", " ")
    assert len(nccl_tests_figure(real).data) == 2


def test_beside_nccl_tests_says_what_differs_from_the_fits():
    from dtlab.course.beside import beside_nccl_tests

    text = beside_nccl_tests(_cpu_like_profile())
    real = dtlab.public_nccl_tests("aws-p5-1x8-h100-nvswitch")
    last = real.segments["all_reduce"][-1]
    assert f"{(1 / 2e9) / last.beta:.3g}x faster per byte" in " ".join(text.split())
    assert "14 on its 8 ranks, 2 on your 2" in " ".join(text.split())
    assert "aws-samples/awsome-distributed" in text and "50.0 us" in text and "2 GB/s" in text


def test_everything_a_calibration_feeds_takes_it():
    from dtlab.model.profile import profile_table
    from dtlab.viz.explorer_state import ExplorerState

    prof = dtlab.public_nccl_tests("cscs-alps-gh200-2x1-slingshot")
    text = profile_table(prof)
    assert "nccl | 2 ranks | 2 nodes x 1 | hosts nid007106, nid007109 | nccl-tests 2.18.2, nccl 23007" in text
    state = ExplorerState(profile=prof)  # the explorer starts at the profile's GPU count, from its fit
    assert state.nproc0 == 2 and "fitted from the profile" in state.ref["how"]


def test_device_and_header_lines_without_their_hash():
    # older nccl-tests printed ' nThread ...' and '   Rank  0 Pid ...' without the leading '#'
    text = "\n".join(x[1:] if re.match(r"#( nThread|  Rank)", x) else x for x in table(p=4).splitlines()) + "\n"
    t = parse_nccl_tests(text)
    assert t.nproc == 4 and t.header["max_bytes"] == 2**24 and t.gpu_models == ["NVIDIA H100 80GB HBM3"]


def test_a_real_curve_gets_the_regimes_its_data_show():
    # A3 Mega: 16 MiB takes 965 us and 32 MiB 1057 us (median of the two columns): NCCL changes algorithm between
    # them, and the fit starts its large-message regime exactly there
    prof = dtlab.public_nccl_tests("gcp-a3mega-h100-2x8-tcpxo")
    starts = [s.min_bytes for s in prof.segments["all_reduce"]]
    assert 2**25 in starts and 2**24 not in starts
    last = prof.segments["all_reduce"][-1]
    assert last.rel_rms < 0.02 < prof.fits["all_reduce"].rel_rms


def test_several_types_in_one_table_are_refused():
    lines = table().splitlines()
    at = _line_of(table(), "  2097152  ")
    lines[at - 1] = lines[at - 1].replace("   float", "  double").replace(" 524288 ", " 262144 ")
    with pytest.raises(NcclTestsDamaged, match=rf"line {at}: type double / redop sum after float / sum .* -d all"):
        parse_nccl_tests("\n".join(lines) + "\n")
