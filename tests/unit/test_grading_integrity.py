"""The autograder's side, cheaply: keys computed from a recording found by the lab's config, the recording's
consistency checks (each tampering found and named), the check-cell fingerprints, the otter hidden test's
separate process, and a student's exception reported with its cell. Reuses the session's one tiny run
(conftest.tiny_run: the quick-mode lab config) and edits copies of it; one small notebook runs in a kernel."""

import json
import pathlib

from dtlab.course import integrity

LABS = pathlib.Path(__file__).resolve().parents[2] / "labs"


def _calibration(root, drop=None):
    """A hand-made 2-rank calibration: 2 sizes x 3 iterations, slowest-rank timings."""
    d = root / "profiles" / "cal"
    (d / "events").mkdir(parents=True)
    cal = {"nproc": 2, "ops": ["all_reduce"], "sizes": [4096, 1 << 20], "iters": 3, "rounds": 1, "nnodes": 1}
    (d / "config.json").write_text(json.dumps({"calibration": cal, "launch": {"time": 100.0}}))
    (d / "status.json").write_text(json.dumps({"state": "finished"}))
    for r in range(2):
        lines = [{"kind": "start", "rank": r, "time": 101.0}]
        lines += [
            {
                "kind": "sample",
                "rank": r,
                "op": "all_reduce",
                "nbytes": n,
                "nproc": 2,
                "iter": i,
                "seconds": 1e-4 * (1 + n / 4096) * (1 + 0.01 * i),
                "time": 102.0 + k,
            }
            for k, (n, i) in enumerate((n, i) for n in (4096, 1 << 20) for i in range(3))
            if (r, n, i) != drop
        ]
        (d / "events" / f"rank{r}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return d


def test_a_calibration_must_time_every_size_on_every_rank(tmp_path):
    assert integrity.calibration_problems(str(_calibration(tmp_path / "ok"))) == []
    bad = _calibration(tmp_path / "bad", drop=(1, 4096, 2))
    assert any("not every rank timed every iteration" in p for p in integrity.calibration_problems(str(bad)))
    assert any("config differs" in p for p in integrity.calibration_problems(str(bad), {"iters": 10}))


def test_check_cells_are_fingerprinted_and_edits_flagged():
    nb = json.loads((LABS / "01_ddp_breakdown.ipynb").read_text())
    cells = integrity.check_cells(nb)
    assert [c["qids"] for c in cells] == [["lab01.q1", "lab01.q2"], ["lab01.q3"]]
    assert integrity.cell_flags(cells, nb) == []
    i = cells[0]["index"]
    nb["cells"][i]["source"] = "".join(nb["cells"][i]["source"]) + "\n\n   "  # whitespace only: the same cell
    assert integrity.cell_flags(cells, nb) == []
    nb["cells"][i]["source"] = "from dtlab.course.checks import check\ncheck('lab01.q1', 4, run=run)"
    nb["cells"].append(
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": "for r in _dtlab_answers.values(): r['ok'] = True",
        }
    )
    flags = integrity.cell_flags(cells, nb)
    assert flags[0] == f"check cell {i + 1} (lab01.q1, lab01.q2) edited or removed", flags
    assert any("is not a distributed cell and uses the checks" in f for f in flags) and len(flags) == 3


def test_notebooks_are_matched_to_their_lab_by_option_name_token_or_metadata(tmp_path):
    from dtlab.course.batch import _student_of, lab_of

    known = {"01_ddp_breakdown": {}, "02_collectives_alpha_beta": {}}
    meta = tmp_path / "submission.ipynb"
    meta.write_text(json.dumps({"cells": [], "metadata": {"otter": {"assignment_name": "02_collectives_alpha_beta"}}}))
    plain = tmp_path / "homework.ipynb"
    plain.write_text(json.dumps({"cells": [], "metadata": {}}))
    assert lab_of(str(tmp_path / "01_ddp_breakdown.ipynb"), known) == ("01_ddp_breakdown", "file name")
    assert lab_of(str(tmp_path / "alice_lab02.ipynb"), known)[0] == "02_collectives_alpha_beta"
    assert lab_of(str(tmp_path / "Bob Smith - Lab 1.ipynb"), known)[0] == "01_ddp_breakdown"
    assert lab_of(str(meta), known) == ("02_collectives_alpha_beta", "notebook metadata")
    assert lab_of(str(plain), known, lab="01_ddp_breakdown") == ("01_ddp_breakdown", "--lab")
    lab, why = lab_of(str(plain), known)
    assert lab is None and "cannot tell which lab" in why and "--lab" in why
    assert lab_of(str(plain), known, lab="lab99")[0] is None
    assert (
        _student_of("/x/alice_lab01.ipynb") == "alice"
        and _student_of("/x/01_ddp_breakdown.ipynb") == "01_ddp_breakdown"
        and _student_of("/x/carol_01_ddp_breakdown.ipynb") == "carol"
    )
