"""RunConfig validation: every bad field is refused before any process starts, naming the field."""

import subprocess
import sys

import pytest

from dtlab import RunConfig, ZeroConfig
from dtlab.cli import main as cli_main


@pytest.mark.parametrize("field,value,needle", [
    ("nproc", 0, "nproc must be an integer >= 1"),
    ("nproc", 1.5, "nproc must be an integer"),
    ("strategy", "fsdp", "strategy must be one of"),
    ("backend", "mpi", "backend must be one of"),
    ("bucket_mb", 0, "bucket_mb must be a number > 0"),
    ("bucket_mb", -3.0, "bucket_mb must be a number > 0"),
    ("steps", 0, "steps must be an integer >= 1"),
    ("batch_size", 0, "batch_size must be an integer >= 1"),
    ("seq_len", 0, "seq_len must be an integer >= 1"),
    ("seq_len", 1024, "seq_len must be <= 512"),
    ("model", "gpt2", "model must be one of"),
    ("model_source", "s3", "model_source must be one of"),
    ("model_path", "/no/such/model", "model_path must be an existing folder"),
    ("data", "/no/such/file.csv", "data must be one of"),
    ("timeout_s", 0, "timeout_s must be a number of seconds > 0"),
    ("baseline_steps", -1, "baseline_steps must be an integer >= 0"),
])
def test_each_bad_field_is_named(field, value, needle):
    cfg = RunConfig(**{field: value})
    with pytest.raises(ValueError, match=needle):
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
    cfg = RunConfig(nproc=3, bucket_mb=5.0, zero={"overlap_comm": False})
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg
    with pytest.raises(ValueError, match="unknown RunConfig field"):
        RunConfig.from_dict({"nprocs": 2})


def test_launch_refuses_before_starting_anything(tmp_path):
    import dtlab
    out = tmp_path / "never"
    with pytest.raises(ValueError, match="bucket_mb"):
        dtlab.launch(RunConfig(bucket_mb=0, out=str(out)))
    assert not out.exists()  # refused before the run directory (or any process) was made


@pytest.mark.parametrize("args,needle", [
    (["--nproc", "0"], "nproc"), (["--bucket-mb", "0"], "bucket_mb"), (["--steps", "0"], "steps"),
    (["--strategy", "x"], "strategy"), (["--model", "x"], "model"), (["--seq-len", "0"], "seq_len"),
    (["--strategy", "zero3", "--zero-reduce-bucket-size", "0"], "zero.reduce_bucket_size"),
    (["--strategy", "zero3", "--zero-max-reuse-distance", "-1"], "zero.stage3_max_reuse_distance"),
])
def test_cli_bad_input_exits_2_with_one_line(args, needle, capsys, tmp_path):
    rc = cli_main(["run", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and needle in err


def test_cli_entry_point_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dtlab.cli", "run", "--nproc", "0", "--out", str(tmp_path / "y")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "nproc must be an integer >= 1" in r.stderr
