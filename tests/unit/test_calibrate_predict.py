"""A real 2-process calibration sweep, DDP prediction from its profile, and sweeps with reuse and skips."""

import pytest

from dtlab.cli.main import main as cli_main
from dtlab.config.calibration import CalibConfig


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(nproc=1), r"nproc x nnodes must be >= 2 \(a collective needs peers\)"),
        (dict(nproc=0), "nproc must be an integer >= 1"),
        (dict(ops=("all_to_all",)), "ops must be"),
        (dict(sizes=()), "sizes must be"),
        (dict(sizes=(0, 8, 16)), "sizes must be"),
        (dict(iters=0), "iters must be"),
        (dict(form="tree"), "form must be"),
        (dict(rounds=5, iters=4), "rounds must be <= iters"),
        (dict(fit_min_bytes=-1), "fit_min_bytes must be"),
        (dict(timeout_s=0), "timeout_s must be"),
        (dict(backend="nccl"), "backend 'nccl' needs CUDA GPUs"),
    ],
)
def test_calibration_config_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        CalibConfig(**kwargs).validate(cuda_device_count=0)


def test_cli_calibrate_bad_input(capsys, tmp_path):
    assert cli_main(["calibrate", "--ops", "all_to_all", "--out", str(tmp_path / "c")]) == 2
    assert "ops must be" in capsys.readouterr().err
    assert cli_main(["calibrate", "--sizes", "4K,lots", "--out", str(tmp_path / "d")]) == 2
    assert "--sizes" in capsys.readouterr().err
