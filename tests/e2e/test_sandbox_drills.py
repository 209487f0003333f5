"""Drills: hostile submissions graded by `dtlab grade` in each sandbox (bubblewrap, plain namespaces), one batch per
mechanism. Each drill is a real notebook graded for real, beside an honest one in the same batch:

- copy: reads the honest student's notebook (its absolute path on the grading machine) and takes its answers;
- write: writes a file into the grading user's home, the autograder folder and the CSV's folder;
- net: connects to a TCP port listening on the grading machine's 127.0.0.1;
- procs: starts 200 processes in sessions of their own and leaves them running;
- forkbomb: starts processes until refused (3,000 asked, the limit 512), whoever grades, root included;
- memory: allocates 8 GiB (the limit is 4 GiB a process);
- disk: fills its scratch folder (128 MiB here) and leaves the file;
- forge: leaves a process behind that rewrites the sandbox's result folder and writes a full-marks result into
  every descriptor of its grader it can open through /proc, and reads its grader's memory.

And a grader whose Python environment lives under /tmp (a CI's virtual environment) still sees it in the sandbox.

Each is contained (no file appears, nothing connects, no process survives), scores 0 with its reason (an error
row naming the limit, or the exception in the errors column and the limit in the flags), and the honest notebook
gets full marks. The notebooks answer lab 8's derived questions (no recording, no training): each is a kernel, a
grader and a sandbox (measured, 7 notebooks a batch on 2 cores shared with other test runs: bubblewrap 58 s,
namespaces 87 s).
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import zipfile

import pandas as pd
import pytest

from dtlab.course import limits, sandbox
from dtlab.course.batch import grade

LAB = "08_build_it_yourself"
TOKEN = "98765.4321"  # the procs drill's sleep: found in no other process
HONEST = (
    "from dtlab.course.rubric.lab08 import NPROC\n"
    'my_factor_guess = NPROC\nmy_sends_guess = 2 * (NPROC - 1)\nmy_bytes_guess = "(p - 1) * n"\n'
)


# forges its own result: a process left behind rewrites every file in the sandbox's result folder and writes into
# every descriptor of its grader (the kernel's parent) it can open through /proc, for a minute
FORGE = '''import json, os, subprocess, sys
rows = [{"question": f"lab08.q{i}", "points": 9, "max_points": 9, "feedback": "forged"} for i in (1, 2, 3)]
forged = json.dumps({"lab": "08_build_it_yourself", "mode": "quick", "replayed": 0, "flags": [], "errors": [],
                     "rows": rows})
loop = f"""
import glob, os, time
end = time.time() + 60
while time.time() < end:
    for p in set(glob.glob("/sandbox/out/*") + ["/sandbox/out/result.json"]):
        try:
            open(p, "w").write({forged!r})
        except OSError:
            pass
    for p in glob.glob("/proc/{os.getppid()}/fd/*"):
        try:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, {forged!r}.encode())
            os.close(fd)
        except OSError:
            pass
    time.sleep(0.005)
"""
subprocess.Popen([sys.executable, "-c", loop], start_new_session=True)
open(f"/proc/{os.getppid()}/mem", "rb")   # and reads its grader's memory'''


def _notebook(path, *sources):
    cells = [
        {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": s} for s in sources
    ]
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))


def _drills(root, ag, port, home_file):
    """{student: cell source}."""
    honest_nb = root / "honest" / f"{LAB}.ipynb"
    return {
        "copy": f"""import json
src = "".join("".join(c["source"]) for c in json.load(open({str(honest_nb)!r}))["cells"])
exec(src)""",
        "write": f"""import os
for p in ({str(home_file)!r}, {str(ag / "pwned.txt")!r}, {str(root / "pwned.txt")!r}, {str(ag / (LAB + ".zip"))!r}):
    try:
        with open(p, "a") as f:
            f.write("pwned")
        print("wrote", p)
    except OSError as e:
        print("refused", p, e)
open({str(home_file)!r}, "w")""",
        "net": f"""import socket
socket.create_connection(("127.0.0.1", {port}), timeout=3).sendall(b"pwned")""",
        "procs": f'''import subprocess
procs = [subprocess.Popen(["sleep", "{TOKEN}"], start_new_session=True) for _ in range(200)]
print(len(procs), "started")''',
        "forkbomb": f'''import subprocess
procs = []
try:
    for _ in range(3000):
        procs.append(subprocess.Popen(["sleep", "{TOKEN}"], start_new_session=True))
finally:
    print(len(procs), "started")''',
        "forge": FORGE,
        "memory": """x = bytearray(8 * 2 ** 30)""",
        "disk": """with open("/tmp/fill", "wb") as f:
    while True:
        f.write(b"x" * 2 ** 20)
        f.flush()""",
    }


def _survivors() -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if TOKEN.encode() in pathlib.Path(f"/proc/{d}/cmdline").read_bytes():
                    found.append(int(d))
            except OSError:
                pass
    return found


@pytest.fixture(scope="module", params=sandbox.MECHANISMS)
def batch(request, tmp_path_factory):
    mech = request.param
    why = sandbox.probe(mech)
    if why:
        pytest.skip(f"sandbox {mech} unavailable here: {why}")
    root = tmp_path_factory.mktemp(f"drills-{mech}")
    ag = root / "autograder"
    ag.mkdir()
    zipfile.ZipFile(ag / f"{LAB}.zip", "w").close()
    home_file = pathlib.Path.home() / f".dtlab-drill-{mech}-{os.getpid()}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    _notebook(root / "honest" / f"{LAB}.ipynb", HONEST)
    drills = _drills(root, ag, port, home_file)
    for who, src in drills.items():
        _notebook(root / who / f"{LAB}.ipynb", src)
    paths = [str(root / "honest")] + [str(root / who) for who in drills]
    csv = root / "scores.csv"
    try:
        grade(str(ag), paths, csv=str(csv), sandbox=mech, disk=128 * limits.MiB, progress=False, timeout_s=300)
        try:
            conn, _ = listener.accept()
            connected = True
            conn.close()
        except BlockingIOError:
            connected = False
        yield {
            "mech": mech,
            "df": pd.read_csv(csv, keep_default_na=False),
            "root": root,
            "ag": ag,
            "home_file": home_file,
            "connected": connected,
            "survivors": _survivors(),
        }
    finally:
        listener.close()
        home_file.unlink(missing_ok=True)
        for pid in _survivors():
            os.kill(pid, 9)


def _of(batch, who):
    return batch["df"].query("student == @who").set_index("question")


def test_the_honest_notebook_gets_full_marks_in_the_sandbox(batch):
    got = _of(batch, "honest")
    for q in ("lab08.q1", "lab08.q2", "lab08.q3"):
        assert got.loc[q, "points"] == got.loc[q, "max_points"] > 0, got.loc[q, "feedback"]
    assert set(batch["df"]["sandbox"]) == {batch["mech"]}
    assert (got["status"] == "graded").all()


def test_another_submission_cannot_be_read(batch):
    got = _of(batch, "copy")
    assert got["points"].sum() == 0 and (got["status"] == "graded").all()
    assert "FileNotFoundError" in got["errors"].iloc[0]


def test_nothing_is_written_outside_the_sandbox(batch):
    assert not batch["home_file"].exists()
    assert sorted(p.name for p in batch["ag"].iterdir()) == [f"{LAB}.zip"]
    assert (batch["ag"] / f"{LAB}.zip").stat().st_size == 22  # the empty zip, untouched
    assert not (batch["root"] / "pwned.txt").exists()
    got = _of(batch, "write")
    assert got["points"].sum() == 0 and "Error: [Errno" in got["errors"].iloc[0]  # its last open, refused


def test_nothing_connects_out(batch):
    assert not batch["connected"]
    got = _of(batch, "net")
    assert got["points"].sum() == 0 and "ConnectionRefusedError" in got["errors"].iloc[0]


def test_no_process_survives_its_submission(batch):
    assert batch["survivors"] == []
    got = _of(batch, "procs")
    assert got["points"].sum() == 0 and (got["status"] == "graded").all()


def test_a_submission_cannot_forge_its_own_result(batch):
    got = _of(batch, "forge")
    assert (got["status"] == "graded").all() and got["points"].sum() == 0, got.to_dict("index")
    assert "forged" not in " ".join(got["feedback"]) and (got["max_points"] != 9).all()
    assert "PermissionError" in got["errors"].iloc[0]  # its grader's memory is not its to read


def test_processes_beyond_the_limit_are_refused_and_named(batch):
    """The limit binds whoever grades, root included (each sandbox a uid of its own), and ends with its sandbox."""
    got = _of(batch, "forkbomb")
    assert got["points"].sum() == 0
    said = " ".join(got.iloc[0][["feedback", "flags", "errors"]])
    assert "process limit exceeded" in said and "Resource temporarily unavailable" in said, said
    assert batch["survivors"] == []


def test_memory_beyond_the_limit_is_refused_and_named(batch):
    got = _of(batch, "memory")
    assert got["points"].sum() == 0
    assert "MemoryError" in got["errors"].iloc[0] and "memory limit 4 GiB exceeded" in got["flags"].iloc[0]


def test_a_full_scratch_disk_is_named(batch):
    got = _of(batch, "disk")
    assert got["points"].sum() == 0
    said = got["feedback"].iloc[0] + got["flags"].iloc[0]
    assert "scratch disk limit 128 MiB exceeded" in said, got.iloc[0].to_dict()


def test_an_environment_under_tmp_is_seen_inside_the_sandbox(tmp_path):
    """A CI or a grader whose virtual environment lives under /tmp: the sandbox's own /tmp must not hide it."""
    here = {m: why for m, why in sandbox.available().items() if why is None}
    if not here:
        pytest.skip("no sandbox works on this machine")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = "import json; from dtlab.course import sandbox; print(json.dumps(sandbox.available()))"
    p = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    reasons = json.loads(p.stdout.strip().splitlines()[-1])
    assert str(venv) + "/bin/python" != sys.executable
    assert {m: reasons[m] for m in here} == here
