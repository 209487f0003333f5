"""nccl-tests output as clusters post it beyond one box: device listings cut short, a web page's text with its
spaces collapsed, launcher messages between the lines; each read whole or refused naming the line."""

import re

import pytest

import dtlab
from dtlab.model import costmodel as cm
from dtlab.results.nccl_tests import NcclTestsDamaged, parse_nccl_tests


def cluster_table(op="all_reduce", nodes=4, per_node=4, alpha=20e-6, beta=1 / 50e9):
    """nccl-tests output of a known ring collective on `nodes` hosts of `per_node` GPUs, one device line per rank."""
    p = nodes * per_node
    sizes = [2**k for k in range(20, 31)]
    lines = [
        f"# nThread 1 nGpus 1 minBytes {sizes[0]} maxBytes {sizes[-1]} step: 2(factor) warmup iters: 5 iters: 20",
        "#",
        "# Using devices",
        *(
            f"#  Rank {r:3d} Group  0 Pid {1000 + r:6d} on node{r // per_node:02d} device  {r % per_node} "
            f"[0000:{r % per_node:02x}:00] NVIDIA H100 80GB HBM3"
            for r in range(p)
        ),
        "NCCL version 2.26.2+cuda12.8",
        "#",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw "
        "#wrong",
    ]
    factor = 2 * (p - 1) / p if op == "all_reduce" else (p - 1) / p
    redop = "none" if op == "all_gather" else "sum"
    for n in sizes:
        t = cm.collective_time(op, "ring", alpha, beta, n, p) * 1e6
        count = n // 4 if op == "all_reduce" else n // 4 // p
        algbw = n / t / 1e3
        perf = f"  {t:7.1f}  {algbw:6.2f}  {algbw * factor:6.2f}      0"
        lines.append(f"{n:12d}  {count:12d}     float  {redop:>6}      -1" + perf + perf)
    lines += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 40.1", "#"]
    return "\n".join(lines) + "\n"


def _cut_listing(text, keep=(0,), last=True):
    """The text with its device lines cut as a posting cuts them: ranks in `keep`, a '...' line, the last rank."""
    lines = text.splitlines()
    dev = [i for i, x in enumerate(lines) if re.match(r"#\s+Rank\s+\d+", x)]
    kept = [lines[i] for i in dev if int(lines[i].split()[2]) in keep] + ["..."] + ([lines[dev[-1]]] if last else [])
    return "\n".join(lines[: dev[0]] + kept + lines[dev[-1] + 1 :]) + "\n"


def test_a_device_listing_cut_short_gives_the_ranks_but_not_the_nodes():
    # 4 nodes of 4: the posting keeps rank 0 (node00) and rank 15 (node03), two hosts of the four
    text = _cut_listing(cluster_table())
    t = parse_nccl_tests(text)
    assert t.nproc == 16 and "ranks listed: 2 of 16" in t.nproc_from
    assert t.nodes is None and "not told" in t.nodes_from and t.skipped_lines == 1  # the '...' line
    assert t.hosts == ["node00", "node03"] and t.gpu_models == ["NVIDIA H100 80GB HBM3"]
    given = parse_nccl_tests(text, nodes=4)
    assert (given.nodes, given.nodes_from) == (4, "given")
    prof = dtlab.load_nccl_tests(text)
    assert "not told" in prof.meta["source"]["nodes_from"] and prof.meta["world_size"] == 16


def test_a_node_count_below_the_hosts_a_cut_listing_names_is_refused():
    text = _cut_listing(cluster_table())
    with pytest.raises(
        ValueError, match=r"nodes=1 contradicts the device lines, which name 2 host\(s\) in the 2 of 16"
    ):
        parse_nccl_tests(text, nodes=1)
    with pytest.raises(ValueError, match=r"nodes=3 contradicts the device lines, which name 4 host\(s\)"):
        parse_nccl_tests(cluster_table(), nodes=3)


def test_a_listing_of_the_last_rank_alone_gives_the_rank_count():
    # as a cloud guide posts a 128-GPU run: '#  Rank 127 ...' and nothing before it
    text = _cut_listing(cluster_table(nodes=8, per_node=4), keep=())
    t = parse_nccl_tests(text, nodes=8)
    assert (t.nproc, t.nodes, t.hosts) == (32, 8, ["node07"])
    assert len(t.rows) == 11 and t.op == "all_reduce" and t.versions["nccl"] == "2.26.2"


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_a_page_text_with_collapsed_spaces_reads_the_same(op):
    text = cluster_table(op=op)
    collapsed = "\n".join(re.sub(r"[ \t]+", " ", x).strip() for x in text.splitlines()) + "\n"
    assert "  " not in collapsed
    a, b = parse_nccl_tests(text), parse_nccl_tests(collapsed)
    assert (
        (b.op, b.nproc, b.nodes, b.hosts)
        == (a.op, a.nproc, a.nodes, a.hosts)
        == (op, 16, 4, ["node00", "node01", "node02", "node03"])
    )
    assert b.rows[["size", "count", "time_us", "ip_busbw"]].equals(a.rows[["size", "count", "time_us", "ip_busbw"]])


def test_a_collapsed_row_with_a_field_missing_is_refused_naming_its_line():
    collapsed = [re.sub(r"[ \t]+", " ", x).strip() for x in cluster_table(op="all_gather").splitlines()]
    at = next(i for i, x in enumerate(collapsed, start=1) if x.startswith("8388608 "))
    fields = collapsed[at - 1].split(" ")
    collapsed[at - 1] = " ".join(fields[:6] + fields[7:])  # algbw gone from the out-of-place column
    with pytest.raises(NcclTestsDamaged, match=rf"line {at}: 12 fields where the table has 13") as err:
        parse_nccl_tests("\n".join(collapsed) + "\n")
    assert err.value.line == at


def test_launcher_messages_between_device_lines_are_skipped_and_counted():
    lines = cluster_table().splitlines()
    at = next(i for i, x in enumerate(lines) if "Rank   8 " in x)
    lines.insert(
        at, "[bm-h100-01:29250] 15 more processes have sent help message help-btl-vader.txt / xpmem-make-failed"
    )
    lines.insert(0, "Run-1 Starting command at 2025-05-22 07:36:17")
    t = parse_nccl_tests("\n".join(lines) + "\n")
    assert t.skipped_lines == 2 and len(t.rows) == 11 and (t.nproc, t.nodes) == (16, 4)
    assert len(t.devices) == 16


def test_a_real_cluster_at_64_gpus_reads_with_its_eight_hosts():
    t = parse_nccl_tests(dtlab.public_nccl_tests().set_index("name").loc["h100-ib-ndr-8x8", "path"])
    assert (t.nproc, t.nodes, len(t.hosts), len(t.devices)) == (64, 8, 8, 64)
    # the posted 8 MiB row: out-of-place 1272.4 us, in-place 321.4 us, both kept as posted
    row = t.rows.set_index("size").loc[8388608]
    assert (row["time_us"], row["ip_time_us"]) == (1272.4, 321.4)


#: a row of 0 bytes as nccl-tests prints it, out-of-place and in-place
ZERO_ROW = "           0             0     float     sum      -1     0.16    0.00    0.00       0" + (
    "     0.13    0.00    0.00       0"
)


def test_zero_byte_rows_before_the_first_size_are_set_aside_and_counted():
    # reduce_scatter_perf -b 8 on 16 ranks: sizes below 16 x 4 B print as rows of 0 bytes, 0 elements
    lines = cluster_table(op="reduce_scatter").splitlines()
    first = next(i for i, x in enumerate(lines) if x.strip().startswith("1048576"))
    lines[first:first] = [ZERO_ROW] * 4
    t = parse_nccl_tests("\n".join(lines) + "\n")
    assert (t.zero_rows, len(t.rows), t.op, t.nproc) == (4, 11, "reduce_scatter", 16)
    assert "size / 16" in t.op_from and t.rows["size"].min() == 2**20
    prof = dtlab.load_nccl_tests("\n".join(lines) + "\n")
    assert prof.meta["source"]["zero_byte_rows"] == 4 and (prof.samples["nbytes"] > 0).all()


def test_a_zero_byte_row_after_a_sized_one_is_refused_naming_its_line():
    lines = cluster_table(op="reduce_scatter").splitlines()
    at = next(i for i, x in enumerate(lines, start=1) if x.strip().startswith("2097152"))
    lines.insert(at, ZERO_ROW)  # after the 2 MiB row: line at + 1
    with pytest.raises(NcclTestsDamaged, match=rf"line {at + 1}: size 0 B does not follow 2,097,152 B") as err:
        parse_nccl_tests("\n".join(lines) + "\n")
    assert err.value.line == at + 1
