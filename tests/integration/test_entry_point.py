"""`python -m dtlab` in a fresh interpreter, as a user types it: the commands it offers, and `--version` naming the
release and where it was imported from. Each starts a Python process that imports the command line (about 2
CPU-seconds), which is why they are here and not in the fast tier."""

import os
import subprocess
import sys

import dtlab


def test_python_m_dtlab_works():
    cp = subprocess.run([sys.executable, "-m", "dtlab", "--help"], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0 and "run" in cp.stdout and "doctor" in cp.stdout and "trace" in cp.stdout


def test_dtlab_version_names_the_release_and_the_package():
    out = subprocess.run(
        [sys.executable, "-m", "dtlab", "--version"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == f"dtlab {dtlab.__version__} from {os.path.dirname(os.path.abspath(dtlab.__file__))}"
