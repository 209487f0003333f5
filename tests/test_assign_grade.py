"""`dtlab assign` and `dtlab grade` on the labs' otter master notebooks (labs/instructor/).

- assign: the student notebooks hold no answer key and no hidden test (grepped for every key line of the
  masters), and they are what labs/ holds (the labs are authored once, in the masters);
- grade: the instructor's solutions of lab 01 (quick mode) and lab 08 get full marks; a lab 08 submission with
  one wrong prediction, a hook that sums, and a ring that skips a chunk loses exactly those questions' points,
  with feedback naming the mistake;
- replay: a lab 01 submission handed in with its recorded runs is graded from them (nothing retrained).
Real otter runs of real notebooks: ~4 minutes together on 2 cores.
"""

import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from dtlab.course.assign import FORBIDDEN, assign, grade

LABS = pathlib.Path(__file__).resolve().parent.parent / "labs"


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    assign(str(LABS / "instructor"), str(out))
    return out


def _sources(path):
    return ["".join(c["source"]) for c in json.loads(pathlib.Path(path).read_text())["cells"]]


def _key_lines(master):
    """Every line of an answer key or solution in a master (between the NO PROMPT markers)."""
    keys = []
    for src in _sources(master):
        for block in re.findall(r"# BEGIN SOLUTION NO PROMPT\n(.*?)# END SOLUTION", src, re.S):
            keys += [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return keys


def test_student_versions_have_no_keys_and_are_the_labs(dist):
    masters = sorted(glob.glob(str(LABS / "instructor" / "*.ipynb")))
    # one master per student lab, and the other way round
    assert [os.path.basename(m) for m in masters] == sorted(p.name for p in LABS.glob("*.ipynb")) and masters
    for master in masters:
        name = os.path.basename(master)
        student = dist / "student" / name
        text = student.read_text()
        keys = _key_lines(master)
        assert len(keys) >= 1, name
        leaked = [k for k in keys if k in text and len(k) > 12 and not k.startswith(("return", "raise", "import ", "from "))]
        assert not leaked, (name, leaked)
        assert not [w for w in FORBIDDEN if w in text], name
        assert (dist / "autograder" / name.replace(".ipynb", ".zip")).exists()
        # labs/ is the student version of the masters, cell for cell
        assert _sources(student) == _sources(LABS / name), f"labs/{name} differs from `dtlab assign` of its master"


def test_lab08_stubs_stay_stubs(dist, tmp_path):
    import importlib.util

    from dtlab.course.exercises import not_implemented
    cells = [src for src in _sources(dist / "student" / "08_build_it_yourself.ipynb") if src.startswith("# EXERCISE")]
    assert len(cells) == 2
    for src in cells:
        assert "raise NotImplementedError" in src and "req.wait()" not in src and "div_(" not in src
    path = tmp_path / "stubs.py"
    path.write_text("\n\n".join(cells) + "\n")
    spec = importlib.util.spec_from_file_location("stubs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not_implemented(mod.my_allreduce_hook) and not_implemented(mod.my_ring_allreduce)


def _planted(dist, tmp_path):
    """Lab 08 as the instructor solved it, with three planted mistakes."""
    nb = json.loads((dist / "instructor" / "08_build_it_yourself.ipynb").read_text())
    for c in nb["cells"]:
        src = "".join(c["source"])
        src = src.replace("my_sends_guess = 2 * (NPROC - 1)", "my_sends_guess = NPROC - 1")  # wrong prediction
        src = src.replace("buf.div_(dist.get_world_size())", "pass")                       # sums, not averages
        src = src.replace("chunks[recv_i].copy_(incoming)", "pass")                          # never all-gathers
        c["source"] = src
    d = tmp_path / "bob"
    d.mkdir()
    (d / "08_build_it_yourself.ipynb").write_text(json.dumps(nb))
    return d


def test_grade_full_marks_for_keys_and_exactly_the_planted_losses(dist, tmp_path):
    good = tmp_path / "alice"
    good.mkdir()
    shutil.copy(dist / "instructor" / "08_build_it_yourself.ipynb", good)
    bad = _planted(dist, tmp_path)
    csv = tmp_path / "scores.csv"
    df = grade(str(dist / "autograder"), [str(good), str(bad)], csv=str(csv), progress=False)
    alice, bob = df[df.student == "alice"].set_index("question"), df[df.student == "bob"].set_index("question")
    assert set(alice.index) == {"lab08.hook", "lab08.ring", "lab08.q1", "lab08.q2", "lab08.q3"}
    assert (alice.points == alice.max_points).all(), alice
    lost = bob[bob.points < bob.max_points]
    assert set(lost.index) == {"lab08.q2", "lab08.hook", "lab08.ring"}, bob
    assert (lost.points == 0).all() and (bob.drop(lost.index).points == bob.drop(lost.index).max_points).all()
    assert "sum instead of average" in lost.loc["lab08.hook", "feedback"]
    assert "never reduced" in lost.loc["lab08.ring", "feedback"] or "chunk" in lost.loc["lab08.ring", "feedback"]
    assert "you said 1" in lost.loc["lab08.q2", "feedback"] and "expected 2" in lost.loc["lab08.q2", "feedback"]
    assert set(df["mode"]) == {"quick"} and (df["replayed"] == 0).all()
    assert len(csv.read_text().splitlines()) == 1 + len(df)


def test_lab01_is_graded_from_its_recorded_runs(dist, tmp_path):
    """The student ran lab 01 (here in quick mode, standing in for a GPU machine) and hands in the notebook
    with its runs/; grading replays them: full marks, mode 'replay', and no new run directory anywhere."""
    from nbclient import NotebookClient
    import nbformat
    sub = tmp_path / "carol"
    sub.mkdir()
    nb = nbformat.read(dist / "instructor" / "01_ddp_breakdown.ipynb", as_version=4)
    env = {"DTLAB_QUICK": "1", "HF_HUB_OFFLINE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(sub)}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    nbformat.write(nb, sub / "01_ddp_breakdown.ipynb")
    runs_before = sorted(os.listdir(sub / "runs"))
    assert len(runs_before) == 1
    # graded from another directory, with quick mode off: only the recording can say how it ran
    out = subprocess.run([sys.executable, "-m", "dtlab", "grade", str(dist / "autograder"), str(sub),
                          "--csv", str(tmp_path / "s.csv")], capture_output=True, text=True, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "DTLAB_QUICK"})
    assert out.returncode == 0, out.stderr[-2000:]
    import pandas as pd
    df = pd.read_csv(tmp_path / "s.csv")
    assert set(df["mode"]) == {"replay"} and (df.points == df.max_points).all() and len(df) == 3, df
    assert (df["replayed"] == 1).all(), df  # the notebook really loaded its one recorded run
    assert sorted(os.listdir(sub / "runs")) == runs_before
    assert not (tmp_path / "runs").exists()
