"""RunConfig validation: every bad field is refused before any process starts, naming the field."""

import subprocess
import sys


def test_cli_entry_point_exit_code(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "dtlab.cli.main", "run", "--nproc", "0", "--out", str(tmp_path / "y")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "nproc must be an integer >= 1" in r.stderr
