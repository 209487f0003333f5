"""`dtlab slurm --dry-run` writes a script Slurm would accept; `dtlab emulate` refuses a shaped link it cannot
make, saying why, and (as root) builds and always tears down the namespace pair. No launch here: the shaped
link's calibration is benchmarks/shaped_link.py, the script's run under a fake srun benchmarks/slurm_fake_cluster.py."""

import json
import os
import re
import subprocess

import pytest

from dtlab.cli.main import main
from dtlab.launching import emulate
from dtlab.launching.emulate import (
    Emulation,
    EmulationUnavailable,
    parse_rate,
    shaping_unavailable,
)

TINY = ["--model", "tiny", "--model-source", "random", "--data", "offline", "--steps", "3", "--warmup", "1"]


def _script(tmp_path, capsys, *extra):
    out = str(tmp_path / "job")
    assert main(["slurm", *TINY, "--out", out, "--nodes", "2", *extra, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert text == open(os.path.join(out, "slurm.sbatch")).read()
    return out, text


def test_slurm_dry_run_writes_an_sbatch_script_with_srun_torchrun_and_c10d(tmp_path, capsys):
    out, text = _script(
        tmp_path,
        capsys,
        "--gpus-per-node",
        "4",
        "--partition",
        "gpu",
        "--time",
        "0:20:00",
        "--sbatch-arg=--account=abc",
    )
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    first_cmd = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert all(
        lines.index(line) < first_cmd for line in sbatch
    )  # sbatch reads directives only before the first command
    for want in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=4",
        "--partition=gpu",
        "--time=0:20:00",
        "--account=abc",
        f"--output={out}/logs/slurm-%j.out",
    ):
        assert f"#SBATCH {want}" in sbatch
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    cmd = " ".join(text.split("\\\n"))  # the srun command with its continuation lines joined
    srun = re.search(r"^srun (.*)$", cmd, re.M).group(1).split()
    assert "--nodes=2" in srun and "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun
    assert f"--output={out}/logs/slurm-%j-node%n.log" in srun  # one log per node
    t = srun[srun.index("torchrun") :]
    for want in (
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$head:$port"',
        '--rdzv-id="$SLURM_JOB_ID"',
        "--max-restarts=0",
    ):
        assert want in t
    assert t[-3:] == ["-m", "dtlab.rank.worker", out]
    assert subprocess.run(["bash", "-n", os.path.join(out, "slurm.sbatch")]).returncode == 0
    doc = json.load(open(os.path.join(out, "config.json")))
    assert (doc["config"]["nnodes"], doc["config"]["nproc"], doc["config"]["out"]) == (2, 4, out)
    assert doc["launch"]["slurm"]["gpus_per_node"] == 4
    assert json.load(open(os.path.join(out, "status.json")))["state"] == "prepared"


def test_slurm_time_limit_defaults_to_the_run_timeout(tmp_path, capsys):
    _, text = _script(tmp_path, capsys, "--timeout-s", "5401")
    assert "#SBATCH --time=0-01:31:00" in text and "--nproc-per-node=2" in text  # CPU nodes: --nproc ranks


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--nodes", "0"], "nodes must be an integer >= 1"),
        (["--nodes", "2", "--gpus-per-node", "-1"], "gpus_per_node must be"),
        (["--nodes", "2", "--steps", "0"], "steps must be an integer >= 1"),
    ],
)
def test_slurm_refuses_bad_input_before_writing(tmp_path, capsys, args, needle):
    out = tmp_path / "job"
    assert main(["slurm", *TINY, "--out", str(out), *args, "--dry-run"]) == 2
    assert needle in capsys.readouterr().err and not out.exists()


def test_slurm_without_sbatch_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert main(["slurm", *TINY, "--out", str(tmp_path / "job"), "--nodes", "2"]) == 1
    assert "sbatch not found" in capsys.readouterr().err and not (tmp_path / "job").exists()


# ---- emulation --------------------------------------------------------------------------------------------


def test_rates_are_tc_rates_in_bytes_per_second():
    assert parse_rate("1gbit") == 125_000_000 and parse_rate("250mbit") == 31_250_000
    with pytest.raises(ValueError, match="rate must be a positive tc rate"):
        parse_rate("1GB/s")
    with pytest.raises(ValueError, match="nnodes must be 2 with a shaped link"):
        Emulation(3, rate="1gbit")
    with pytest.raises(ValueError, match="nnodes must be an integer >= 2"):
        Emulation(1)


@pytest.mark.parametrize(
    "patch,needle",
    [
        ({"geteuid": lambda: 1000}, "needs root"),
        ({"which": lambda name: None if name == "tc" else "/usr/sbin/" + name}, "`tc` not found"),
    ],
)
def test_a_shaped_link_is_refused_with_the_reason_and_nothing_made(tmp_path, capsys, monkeypatch, patch, needle):
    if "geteuid" in patch:
        monkeypatch.setattr(emulate.os, "geteuid", patch["geteuid"])
    else:
        monkeypatch.setattr(emulate.shutil, "which", patch["which"])
    made = []
    monkeypatch.setattr(emulate, "_run", lambda cmd: made.append(cmd))
    assert needle in shaping_unavailable()
    with pytest.raises(EmulationUnavailable, match=needle):
        with Emulation(2, rate="1gbit"):
            pass
    assert made == []
    assert main(["emulate", "check"]) == 3 and needle in capsys.readouterr().out
    assert main(["emulate", "run", *TINY, "--nproc", "1", "--rate", "1gbit", "--out", str(tmp_path / "r")]) == 3
    assert "skipped" in capsys.readouterr().err and not (tmp_path / "r").exists()
