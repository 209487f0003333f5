"""RunConfig validation: every bad field is refused before any process starts, naming the field."""

import re

import pytest

from dtlab.cli.main import main as cli_main
from dtlab.config.run import RunConfig, ZeroConfig, tiny


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("nproc", 0, "nproc must be an integer >= 1"),
        ("nproc", 1.5, "nproc must be an integer"),
        ("strategy", "fsdp", "strategy must be one of"),
        ("backend", "mpi", "backend must be one of"),
        ("bucket_mb", 0, "bucket_mb must be a finite number > 0"),
        ("bucket_mb", -3.0, "bucket_mb must be a finite number > 0"),
        ("bucket_mb", float("inf"), "bucket_mb must be a finite number > 0"),
        ("bucket_mb", float("nan"), "bucket_mb must be a finite number > 0"),
        ("bucket_mb", 2.0**21, "bucket_mb must be a finite number > 0 and <= 1,048,576"),
        ("bucket_mb", "25", "bucket_mb must be a finite number"),
        ("lr", float("nan"), "lr must be a finite number > 0"),
        ("lr", float("inf"), "lr must be a finite number > 0"),
        ("lr", 0.0, "lr must be a finite number > 0"),
        ("seed", -1, "seed must be an integer in [0, 2**32)"),
        ("seed", 2**40, "seed must be an integer in [0, 2**32)"),
        ("stall_s", 0, "stall_s must be a finite number > 0"),
        ("stall_s", float("inf"), "stall_s must be a finite number > 0"),
        ("timeout_s", float("inf"), "timeout_s must be a finite number > 0"),
        ("out", 3, "out must be a path"),
        ("data", 7, "data must be a string"),
        ("steps", 0, "steps must be an integer >= 1"),
        ("batch_size", 0, "batch_size must be an integer >= 1"),
        ("seq_len", 0, "seq_len must be an integer >= 1"),
        ("seq_len", 1024, "seq_len must be <= 512"),
        ("model", "gpt2", "model must be one of"),
        ("model_source", "s3", "model_source must be one of"),
        ("model_path", "/no/such/model", "model_path must be an existing folder"),
        ("data", "/no/such/file.csv", "data must be one of"),
        ("timeout_s", 0, "timeout_s must be a finite number > 0 (seconds)"),
        ("baseline_steps", -1, "baseline_steps must be an integer >= 0"),
    ],
)
def test_each_bad_field_is_named(field, value, needle):
    cfg = RunConfig(**{field: value})
    with pytest.raises(ValueError, match=re.escape(needle)):
        cfg.validate(cuda_device_count=0)


def test_warmup_must_leave_measured_steps():
    with pytest.raises(ValueError, match="warmup must be smaller than steps"):
        RunConfig(steps=2, warmup=2).validate(cuda_device_count=0)


def test_nccl_without_cuda_is_refused():
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA GPUs"):
        RunConfig(backend="nccl").validate(cuda_device_count=0)


def test_more_ranks_than_gpus_under_nccl_is_refused():
    with pytest.raises(ValueError, match=r"nproc must be <= 2 \(GPUs on this machine\)"):
        RunConfig(backend="nccl", nproc=4).validate(cuda_device_count=2)
    RunConfig(backend="nccl", nproc=2).validate(cuda_device_count=2)  # fits: no error


def test_auto_backend_resolution():
    assert RunConfig(nproc=2).resolved_backend(cuda_device_count=0) == "gloo"
    assert RunConfig(nproc=2).resolved_backend(cuda_device_count=4) == "nccl"
    assert RunConfig(nproc=8).resolved_backend(cuda_device_count=4) == "gloo"


def test_zero_fields_are_validated_by_name():
    with pytest.raises(ValueError, match="zero.reduce_bucket_size"):
        RunConfig(strategy="zero3", zero=ZeroConfig(reduce_bucket_size=0)).validate(cuda_device_count=0)
    with pytest.raises(ValueError, match="zero.stage3_param_persistence_threshold"):
        RunConfig(strategy="zero3", zero={"stage3_param_persistence_threshold": -1}).validate(cuda_device_count=0)


def test_local_data_file_must_have_known_extension(tmp_path):
    p = tmp_path / "data.txt"
    p.write_text("x")
    with pytest.raises(ValueError, match="data file must end in"):
        RunConfig(data=str(p)).validate(cuda_device_count=0)


def test_round_trip_and_unknown_keys():
    cfg = RunConfig(nproc=3, bucket_mb=5.0, stall_s=30.0, zero={"overlap_comm": False})
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.stall_s == 30.0
    with pytest.raises(ValueError, match="unknown RunConfig field.*: nprocs;"):
        RunConfig.from_dict({"nprocs": 2})
    with pytest.raises(ValueError, match="unknown RunConfig field.*: bogus;"):  # RunConfig(bogus=1), as a dict
        RunConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match=r"unknown zero field\(s\): bogus;"):  # nested
        RunConfig.from_dict({**cfg.to_dict(), "zero": {"bogus": 1}})
    with pytest.raises(ValueError, match=r"unknown zero field\(s\): bogus;"):
        RunConfig(zero={"bogus": 1, "overlap_comm": True})
    with pytest.raises(ValueError, match="unknown RunConfig field.*: bucket_size"):
        tiny(bucket_size=3)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


GOOD_ROWS = [("a gripping film", 1), ("a dull , tedious film", 0)] * 4  # 8 rows = batch_size 4 x nproc 2


@pytest.mark.parametrize(
    "name,text",
    [
        ("d.csv", "sentence,label\n" + "".join(f'"{s}",{y}\n' for s, y in GOOD_ROWS)),
        ("d.tsv", "sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in GOOD_ROWS)),
        ("d.jsonl", "".join(f'{{"sentence": "{s}", "label": {y}, "idx": 3}}\n' for s, y in GOOD_ROWS)),
        ("d.json", "[" + ",".join(f'{{"sentence": "{s}", "label": {y}.0}}' for s, y in GOOD_ROWS) + "]"),
    ],
)
def test_good_data_files_pass_and_are_what_the_ranks_read(tmp_path, name, text):
    from dtlab.config.datafile import read_data_file
    from dtlab.rank.data import load_sentences

    path = _write(tmp_path, name, text)
    tiny(data=path).validate(cuda_device_count=0)
    assert read_data_file(path) == ([s for s, _ in GOOD_ROWS], [y for _, y in GOOD_ROWS])
    # a run needing more rows than the file has cycles through it, and says so
    sents, labels, source = load_sentences(path, 20, seed=0)
    assert len(sents) == 20 and set(labels) == {0, 1} and "8 rows, cycled 2.5 times" in source


def test_parquet_data_file(tmp_path):
    import pandas as pd

    path = str(tmp_path / "d.parquet")
    pd.DataFrame({"sentence": [s for s, _ in GOOD_ROWS], "label": [y for _, y in GOOD_ROWS]}).to_parquet(path)
    tiny(data=path).validate(cuda_device_count=0)


@pytest.mark.parametrize(
    "name,text,needle",
    [
        ("d.csv", "text,label\nok,1\n", "lacks column(s) sentence"),
        ("d.csv", "sentence,target\nok,1\n", "lacks column(s) label"),
        ("d.csv", "sentence,label\nok,1\nfine,7\n", "row 2: label must be the number 0 or 1"),
        ("d.csv", "sentence,label\nok,1\nfine,-1\n", "row 2: label must be the number 0 or 1"),
        ("d.csv", "sentence,label\nok,0.5\n", "row 1: label must be the number 0 or 1"),
        ("d.csv", "sentence,label\nok,positive\n", "row 1: label must be the number 0 or 1"),
        ("d.csv", "sentence,label\nok,\n", "row 1: label must be the number 0 or 1"),
        ("d.csv", "sentence,label\n,1\n", "row 1: sentence must be non-empty text"),
        ("d.csv", "sentence,label\n", "has no rows"),
        ("d.csv", "", "cannot read"),
        ("d.jsonl", '{"sentence": "ok", "label": true}\n', "row 1: label must be the number 0 or 1"),
        ("d.jsonl", '{"sentence": null, "label": 1}\n', "row 1: sentence must be non-empty text"),
        ("d.jsonl", '{"sentence": "ok", "label": 1}\n{broken\n', "cannot read"),
        ("d.csv", "sentence,label\n" + "ok,1\n" * 7, "has 7 row(s); a run needs at least batch_size x nproc = 8"),
    ],
)
def test_bad_data_files_are_refused_by_problem(tmp_path, name, text, needle):
    path = _write(tmp_path, name, text)
    with pytest.raises(ValueError) as info:
        tiny(data=path).validate(cuda_device_count=0)
    msg = str(info.value)
    assert msg.startswith("data: ") and needle in msg and "\n" not in msg


def test_launch_refuses_before_starting_anything(tmp_path):
    import dtlab

    out = tmp_path / "never"
    with pytest.raises(ValueError, match="bucket_mb"):
        dtlab.launch(RunConfig(bucket_mb=0, out=str(out)))
    assert not out.exists()  # refused before the run directory (or any process) was made


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--nproc", "0"], "nproc"),
        (["--bucket-mb", "0"], "bucket_mb"),
        (["--steps", "0"], "steps"),
        # non-finite numbers may be refused by the parser (naming the flag) or by validation (naming the field)
        (["--bucket-mb", "inf"], r"bucket[-_]mb.*finite number"),
        (["--bucket-mb", "nan"], r"bucket[-_]mb"),
        (["--timeout", "inf"], r"timeout.*finite number"),
        (["--stall", "-2"], "stall_s"),
        (["--strategy", "x"], "strategy"),
        (["--model", "x"], "model"),
        (["--seq-len", "0"], "seq_len"),
        (["--strategy", "zero3", "--zero-reduce-bucket-size", "0"], "zero.reduce_bucket_size"),
        (["--strategy", "zero3", "--zero-max-reuse-distance", "-1"], "zero.stage3_max_reuse_distance"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, needle, capsys, tmp_path):
    try:
        rc = cli_main(["run", "--out", str(tmp_path / "x"), *args])
    except SystemExit as e:  # refused by the argument parser itself
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and re.search(needle, err)
    assert not (tmp_path / "x").exists()
