"""`dtlab assign` and `dtlab grade` on the labs' otter master notebooks (instructor/).

- assign: the student notebooks hold no answer key, no hidden test and no key of a check (no formula, no
  expected value), they are what labs/ holds, and every autograder zip carries dtlab's manifest and README;
- grade, lab 08 (quick mode): the instructor's solutions get full marks; one wrong prediction, a hook that sums
  and a ring that skips a chunk lose exactly those questions' points, with feedback naming the mistake;
- grade, lab 01 (replay of one recorded quick run, in one batch): the keys get full marks; a blank notebook and
  the cheats (a redefined check, rewritten records, a monkeypatched `graded`, forged outputs) score 0 on every
  question, those that touched the checks flagged; a truncated notebook gets error rows and everyone else's grades
  are in the CSV; an LMS-style name and a name-less notebook are matched to their lab.
Real notebooks and real ranks: 9 minutes together on 2 cores shared with other test runs (measured: the assign
fixture 163 s, lab 08 218 s, the lab 01 batch 159 s, the blank run 7 s).
"""

import copy as copy_
import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from dtlab.course.assign import FORBIDDEN, assign, read_manifest
from dtlab.course.batch import grade
from dtlab.course.checks import MIME, parse_answers, score
from dtlab.course.integrity import CHECK_MARK

LABS = pathlib.Path(__file__).resolve().parents[2] / "labs"


MASTERS = LABS.parent / "instructor"
LAB01 = "01_ddp_breakdown.ipynb"


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    assign(str(MASTERS), str(out))
    return out


def _nb(path):
    return json.loads(pathlib.Path(path).read_text())


def _sources(path):
    return ["".join(c["source"]) for c in _nb(path)["cells"]]


def _key_lines(master):
    """Every line of an answer key or solution in a master (between the NO PROMPT markers)."""
    keys = []
    for src in _sources(master):
        for block in re.findall(r"# BEGIN SOLUTION NO PROMPT\n(.*?)# END SOLUTION", src, re.S):
            keys += [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return keys


def test_student_versions_have_no_keys_and_are_the_labs(dist):
    masters = sorted(glob.glob(str(MASTERS / "*.ipynb")))
    # one master per student lab, and the other way round
    assert [os.path.basename(m) for m in masters] == sorted(p.name for p in LABS.glob("*.ipynb")) and masters
    for master in masters:
        name = os.path.basename(master)
        student = dist / "student" / name
        text = student.read_text()
        keys = _key_lines(master)
        assert len(keys) >= 1, name
        leaked = [
            k for k in keys if k in text and len(k) > 12 and not k.startswith(("return", "raise", "import ", "from "))
        ]
        assert not leaked, (name, leaked)
        assert not [w for w in FORBIDDEN if w in text], name
        # a check cell computes nothing of its key: no lambda, no expected text, no explicit check_* with a value
        checks = [s for s in _sources(student) if CHECK_MARK.search(s)]  # the cells that import the checks
        assert checks and not [
            s for s in checks if re.search(r"lambda|expected_text|check_(number|choice|formula)\(", s)
        ]
        zip_path = dist / "autograder" / name.replace(".ipynb", ".zip")
        m = read_manifest(str(zip_path))
        assert m["lab"] == name[:-6] and len(m["check_cells"]) == len(checks) and m["questions"]
        # labs/ is the student version of the masters, cell for cell
        assert _sources(student) == _sources(LABS / name), f"labs/{name} differs from `dtlab assign` of its master"


def test_lab08_stubs_stay_stubs(dist, tmp_path):
    import importlib.util

    from dtlab.course.shipping import not_implemented

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
    nb = _nb(dist / "instructor" / "08_build_it_yourself.ipynb")
    for c in nb["cells"]:
        src = "".join(c["source"])
        src = src.replace("my_sends_guess = 2 * (NPROC - 1)", "my_sends_guess = NPROC - 1")  # wrong prediction
        src = src.replace("buf.div_(dist.get_world_size())", "pass")  # sums, not averages
        src = src.replace("chunks[recv_i].copy_(incoming)", "pass")  # never all-gathers
        c["source"] = src
    d = tmp_path / "bob"
    d.mkdir()
    (d / "08_build_it_yourself.ipynb").write_text(json.dumps(nb))
    return d


def test_grade_full_marks_for_the_instructors_solutions(dist, tmp_path):
    good = tmp_path / "alice"
    good.mkdir()
    shutil.copy(dist / "instructor" / "08_build_it_yourself.ipynb", good)
    csv = tmp_path / "scores.csv"
    df = grade(str(dist / "autograder"), [str(good)], csv=str(csv), progress=False)
    alice = df[df.student == "alice"].set_index("question")
    assert set(alice.index) == {"lab08.hook", "lab08.ring", "lab08.q1", "lab08.q2", "lab08.q3"}
    assert (alice.points == alice.max_points).all(), alice
    assert set(df["mode"]) == {"quick"} and (df["replayed"] == 0).all() and set(df["status"]) == {"graded"}
    assert len(csv.read_text().splitlines()) == 1 + len(df)


def test_grade_takes_exactly_the_planted_mistakes_points(dist, tmp_path):
    bad = _planted(dist, tmp_path)
    df = grade(str(dist / "autograder"), [str(bad)], progress=False)
    bob = df[df.student == "bob"].set_index("question")
    assert set(bob.index) == {"lab08.hook", "lab08.ring", "lab08.q1", "lab08.q2", "lab08.q3"}
    lost = bob[bob.points < bob.max_points]
    assert set(lost.index) == {"lab08.q2", "lab08.hook", "lab08.ring"}, bob
    assert (lost.points == 0).all() and (bob.drop(lost.index).points == bob.drop(lost.index).max_points).all()
    assert "sum instead of average" in lost.loc["lab08.hook", "feedback"]
    assert "never reduced" in lost.loc["lab08.ring", "feedback"] or "chunk" in lost.loc["lab08.ring", "feedback"]
    assert "you said 1" in lost.loc["lab08.q2", "feedback"] and "too low" in lost.loc["lab08.q2", "feedback"]
    assert set(df["mode"]) == {"quick"} and (df["replayed"] == 0).all() and set(df["status"]) == {"graded"}


# ---- lab 01: the keys, a blank notebook and the cheats, graded from one recorded quick run ----------------------


CHEAT_REDEFINE = """import dtlab.course.checks as checks, dtlab.course.verdicts as verdicts
_judge = verdicts.judge
verdicts.judge = checks.judge = lambda key, answer: _judge(key, key.expected)   # every answer is the key


def check(qid, answer, **sources):
    from dtlab.course import rubric
    key = rubric.key(qid, **sources)
    return checks.show(key, key.expected)
checks.check = check
check_number_orig = checks.check_number
checks.check_number = lambda qid, guess, expected, **kw: check_number_orig(qid, expected, expected, **kw)"""


CHEAT_RECORDS = """import dtlab.course.checks as c
for rec in c.RECORDED.values():
    rec.update(ok=True, points=rec["max_points"])
_dtlab_answers = {q: {"qid": q, "ok": True, "points": 2, "max_points": 2}
                  for q in ("lab01.q1", "lab01.q2", "lab01.q3")}"""


CHEAT_GRADED = """import dtlab.course.checks, dtlab.course.autograde, dtlab.course.grader
dtlab.course.checks.graded = lambda *a, **k: None
dtlab.course.autograde.graded = lambda *a, **k: None
dtlab.course.grader.grade_answers = lambda *a, **k: []"""


def _cell(src, outputs=()):
    return {
        "cell_type": "code",
        "metadata": {},
        "execution_count": 1 if outputs else None,
        "outputs": list(outputs),
        "source": src,
    }


def _trimmed(student):
    """Lab 01's student version with only what its checks need (setup, predictions, the run, the check cells):
    the cheats' base, cheap to execute."""
    nb = copy_.deepcopy(student)
    keep = (
        "from dtlab.lab import lab_config,",
        "my_bytes_guess = None",
        "run = dtlab.run(cfg)",
        "from dtlab.lab import check\n",
        "my_unhidden_bucket = None",
    )
    nb["cells"] = [c for c in nb["cells"] if c["cell_type"] == "code" and any(k in "".join(c["source"]) for k in keep)]
    return nb


def _forged(nb):
    """A never-run notebook whose check cells carry pasted outputs claiming full marks."""
    for c in nb["cells"]:
        for qid, pts in (("lab01.q1", 2), ("lab01.q2", 1), ("lab01.q3", 1)):
            if f'"{qid}"' in "".join(c["source"]):
                rec = {
                    "qid": qid,
                    "kind": "number",
                    "answer": 1,
                    "ok": True,
                    "points": pts,
                    "max_points": pts,
                    "verdict": f"[{qid}] correct",
                }
                c["outputs"].append(
                    {"output_type": "display_data", "metadata": {}, "data": {MIME: rec, "text/plain": rec["verdict"]}}
                )
                c["execution_count"] = 1
    return nb


@pytest.fixture(scope="module")
def lab01_batch(dist, tmp_path_factory):
    """One quick lab 01 run recorded once, copied into every submission; one batch graded from them."""
    import dtlab
    from dtlab.course.labs import lab_config

    root = tmp_path_factory.mktemp("lab01")
    rec = root / "recorded"
    rec.mkdir()
    env = {"DTLAB_QUICK": "1", "HF_HUB_OFFLINE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        dtlab.run(lab_config(out=str(rec / "runs" / "lab01")), progress=False)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    student = _nb(dist / "student" / LAB01)
    trimmed = _trimmed(student)
    subs = {
        "keys": ("01_ddp_breakdown.ipynb", _nb(dist / "instructor" / LAB01)),
        "blank": ("01_ddp_breakdown.ipynb", student),
    }
    redefine = copy_.deepcopy(trimmed)
    redefine["cells"].insert(1, _cell(CHEAT_REDEFINE))
    for c in redefine["cells"]:  # and the distributed check cell itself, edited
        c["source"] = "".join(c["source"]).replace('check("lab01.q1", my_bytes_guess', 'check("lab01.q1", None')
    records = copy_.deepcopy(trimmed)
    records["cells"].append(_cell(CHEAT_RECORDS))
    patched = copy_.deepcopy(trimmed)
    patched["cells"].append(_cell(CHEAT_GRADED))
    subs.update(
        redefine=("01_ddp_breakdown.ipynb", redefine),
        records=("01_ddp_breakdown.ipynb", records),
        patched=("patched_lab01.ipynb", patched),  # an LMS-style name
        forged=("submission.ipynb", _forged(copy_.deepcopy(trimmed))),
    )  # only the metadata says which lab
    paths = []
    for who, (name, nb) in subs.items():
        d = root / who
        shutil.copytree(rec, d)
        (d / name).write_text(json.dumps(nb))
        paths.append(str(d))
    # the keys' student also handed in a pre-lab first: one prediction right (the tiny model's gradient bytes, typed
    # as a number), one wrong, one left open; graded against the runs of the lab notebook beside it
    pre = _nb(dist / "prelab" / "01_ddp_breakdown_prelab.ipynb")
    for c in pre["cells"]:
        c["source"] = (
            "".join(c["source"])
            .replace("my_bytes_guess = None", "my_bytes_guess = 4045448")
            .replace("my_buckets_guess = None", "my_buckets_guess = 1000")
        )
    (root / "keys" / "01_ddp_breakdown_prelab.ipynb").write_text(json.dumps(pre))
    corrupt = root / "trudy"
    corrupt.mkdir()
    (corrupt / LAB01).write_text(json.dumps(student)[:4000])  # truncated mid-file
    paths.insert(2, str(corrupt))
    csv = root / "scores.csv"
    out = subprocess.run(
        [sys.executable, "-m", "dtlab", "grade", str(dist / "autograder"), *paths, "--csv", str(csv)],
        capture_output=True,
        text=True,
        cwd=root,
        env={k: v for k, v in os.environ.items() if k != "DTLAB_QUICK"},
    )
    return {"out": out, "csv": csv, "df": pd.read_csv(csv, keep_default_na=False), "root": root}


def test_a_corrupt_notebook_gets_error_rows_and_the_batch_goes_on(lab01_batch):
    out, df = lab01_batch["out"], lab01_batch["df"]
    assert out.returncode == 0, out.stderr[-2000:]
    assert "1 notebook(s) could not be graded" in out.stderr
    assert sorted(df["student"].unique()) == sorted(
        ["keys", "blank", "trudy", "redefine", "records", "patched", "forged"]
    )
    trudy = df[df.student == "trudy"]
    assert set(trudy["question"]) == {"lab01.q1", "lab01.q2", "lab01.q3"} and (trudy["status"] == "error").all()
    assert (trudy["points"] == 0).all() and trudy["feedback"].str.contains("unreadable notebook").all()
    assert "\n" not in "".join(trudy["feedback"])
    assert (df[df.student != "trudy"]["status"] == "graded").all()


def test_the_keys_get_full_marks_from_their_recorded_run(lab01_batch):
    df = lab01_batch["df"].query("student == 'keys'")
    keys = df[~df.question.str.endswith("(pre-lab)")]
    assert len(keys) == 3 and (keys.points == keys.max_points).all(), keys
    assert set(keys["mode"]) == {"replay"} and (keys["replayed"] == 1).all() and (keys["flags"] == "").all()
    assert not (lab01_batch["root"] / "runs").exists()  # nothing ran where dtlab grade was started


def test_a_prelab_is_graded_against_the_runs_of_its_lab(dist, lab01_batch):
    assert sorted(p.name for p in (dist / "prelab").glob("*.ipynb"))[:2] == [
        "00_setup_check_prelab.ipynb",
        "01_ddp_breakdown_prelab.ipynb",
    ]
    df = lab01_batch["df"].query("student == 'keys'").set_index("question")
    pre = df[df.index.str.endswith("(pre-lab)")]
    assert list(pre.index) == ["lab01.q1 (pre-lab)", "lab01.q2 (pre-lab)", "lab01.q3 (pre-lab)"]
    assert pre.loc["lab01.q1 (pre-lab)", "points"] == 2 and pre.loc["lab01.q2 (pre-lab)", "points"] == 0
    assert "not answered yet" in pre.loc["lab01.q3 (pre-lab)", "feedback"]
    assert (pre["notebook"] == "01_ddp_breakdown.ipynb").all()  # graded with its lab, not alone


@pytest.mark.parametrize("who", ["blank", "redefine", "records", "patched", "forged"])
def test_a_blank_or_cheating_notebook_scores_nothing(lab01_batch, who):
    got = lab01_batch["df"].query("student == @who")
    assert len(got) == 3 and (got.points == 0).all() and (got["status"] == "graded").all(), got
    assert got["feedback"].str.contains("not answered").all(), got
    if who in ("redefine", "records", "patched"):  # they touched the checks: the CSV says so
        assert got["flags"].str.contains("uses the checks").all(), got
    if who == "redefine":
        assert got["flags"].str.contains(r"check cell \d+ \(lab01.q1, lab01.q2\) edited").all()
    if who in ("blank", "forged"):
        assert (got["flags"] == "").all(), got


def test_forged_outputs_claim_full_marks_only_where_nobody_grades(lab01_batch):
    """parse_answers reads what a notebook file says (formative): the forged file claims 4 of 4; the grade is 0."""
    nb = lab01_batch["root"] / "forged" / "submission.ipynb"
    assert score(parse_answers(nb))["points"] == 4
    assert lab01_batch["df"].query("student == 'forged'")["points"].sum() == 0


def test_a_blank_run_shows_no_key(lab01_batch, tmp_path):
    """The blank notebook executed (replaying the recorded run): no check output holds or prints a key."""
    import nbformat
    from nbclient import NotebookClient

    d = lab01_batch["root"] / "blank"
    nb = nbformat.reads(json.dumps(_trimmed(_nb(d / LAB01))), as_version=4)
    env = dict(os.environ, DTLAB_REPLAY=str(d), HF_HUB_OFFLINE="1")
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(d)}}).execute(env=env)
    from dtlab.results.run import load_run

    run = load_run(str(d / "runs" / "lab01"))
    grad = run.resolved["grad_bytes"]
    outs = [o for c in nb.cells for o in c.get("outputs", []) if MIME in o.get("data", {})]
    assert len(outs) == 3
    for o in outs:
        rec, text = o["data"][MIME], o["data"]["text/plain"]
        assert "expected" not in rec and "not answered yet" in text
        assert str(grad) not in json.dumps(rec) + text and f"{grad:,}" not in json.dumps(rec) + text
