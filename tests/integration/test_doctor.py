"""`dtlab doctor` on this CPU machine, and what it would say on GPU machines (pure placement per lab)."""

import pathlib
import subprocess
import sys

LABS_DIR = pathlib.Path(__file__).resolve().parents[2] / "labs"


NOTEBOOKS = sorted(p.stem for p in LABS_DIR.glob("[0-9][0-9]_*.ipynb"))


def test_doctor_cli_says_no_gpu_and_where_every_lab_runs():
    cp = subprocess.run(
        [sys.executable, "-m", "dtlab", "doctor", "--no-hub"], capture_output=True, text=True, timeout=300
    )
    assert cp.returncode == 0, cp.stderr
    out = cp.stdout
    assert "GPUs: none visible to torch" in out and "CPU cores:" in out and "deepspeed" in out
    heads = [ln.strip() for ln in out.splitlines() if ln.startswith("    ") and not ln.startswith("        ")]
    assert [h[:2] for h in heads] == [n[:2] for n in NOTEBOOKS]  # every lab in labs/, in order
    runs = [ln for ln in out.splitlines() if ln.startswith("        ")]
    assert len(runs) >= len(NOTEBOOKS) and all("gloo on CPU" in ln for ln in runs)
    assert "timed with wall clocks" in out
