"""`dtlab slurm` submits, through a stand-in sbatch process, the script its dry run wrote. The script and the refusals:
tests/unit/test_slurm_emulate.py."""

import json
import os

from dtlab.cli.main import main

TINY = ["--model", "tiny", "--model-source", "random", "--data", "offline", "--steps", "3", "--warmup", "1"]


def _script(tmp_path, capsys, *extra):
    out = str(tmp_path / "job")
    assert main(["slurm", *TINY, "--out", out, "--nodes", "2", *extra, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert text == open(os.path.join(out, "slurm.sbatch")).read()
    return out, text


def test_slurm_submits_where_its_dry_run_wrote(tmp_path, capsys, monkeypatch):
    """A dry run writes the script without claiming the run directory: the same command without --dry-run then
    submits the job there (it was refused as "already holds a run"). The submission claims the directory (events/),
    so a second submission, and a dry run after it, are refused."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 4242\n")  # a submit host's sbatch: prints the job id
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out, dry = _script(tmp_path, capsys)
    assert not os.path.exists(os.path.join(out, "events"))
    assert json.load(open(os.path.join(out, "status.json")))["dry_run"] is True
    _script(tmp_path, capsys, "--timeout-s", "5401")  # another look, other flags: written again
    assert main(["slurm", *TINY, "--out", out, "--nodes", "2"]) == 0
    assert "submitted job 4242" in capsys.readouterr().out
    status = json.load(open(os.path.join(out, "status.json")))
    assert status["state"] == "submitted" and status["slurm_job_id"] == "4242" and "dry_run" not in status
    assert os.path.isdir(os.path.join(out, "events")) and open(os.path.join(out, "slurm.sbatch")).read() == dry
    for extra in ([], ["--dry-run"]):
        assert main(["slurm", *TINY, "--out", out, "--nodes", "2", *extra]) == 2
        assert "already holds a run" in capsys.readouterr().err


# ---- emulation --------------------------------------------------------------------------------------------
