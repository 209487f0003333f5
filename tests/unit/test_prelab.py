"""Pre-labs (dtlab.course.prelab): the prediction cells of a lab alone, read back without running anything."""

import json

import pytest

from dtlab.course import prelab

LAB12 = "labs/12_what_does_it_cost.ipynb"


def test_a_prelab_holds_the_prediction_cells_alone(tmp_path):
    out = tmp_path / "12_what_does_it_cost_prelab.ipynb"
    asked = prelab.make(LAB12, str(out))
    assert asked == ["lab12.q1", "lab12.q2", "lab12.q3", "lab12.q4", "lab12.q5", "lab12.q6"]
    nb = json.loads(out.read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(code) == 4 and all(line.split("=")[0].strip().startswith("my_") for c in code for line in c.splitlines())
    assert "dtlab.run" not in json.dumps(nb) and "check(" not in json.dumps(nb)  # nothing that runs or checks
    assert sum("**Predict.**" in "".join(c["source"]) for c in nb["cells"]) == 4  # each question's own text
    assert prelab.prelab_of(str(out)) == "12_what_does_it_cost" and prelab.prelab_of(LAB12) is None


def test_a_prelabs_answers_are_read_as_written_never_run(tmp_path):
    out = tmp_path / "p.ipynb"
    prelab.make(LAB12, str(out), "12_what_does_it_cost")
    nb = json.loads(out.read_text())
    expr = "ceil(epoch_samples / samples_per_step) * t_step_s / 3600"
    edits = {
        "my_gpu_hours_per_epoch = None": f"my_gpu_hours_per_epoch = {expr!r}",
        "my_usd_per_epoch = None": "my_usd_per_epoch = __import__('os').system('touch /tmp/pwned')",
        "my_cheapest_gpus = None": "my_cheapest_gpus = 1",
        "my_best_interval_s = None": "my_best_interval_s = 60.5",
    }
    for c in nb["cells"]:
        src = "".join(c["source"])
        for old, new in edits.items():
            src = src.replace(old, new)
        c["source"] = src
    out.write_text(json.dumps(nb))
    got = prelab.answers(str(out))
    assert got["my_gpu_hours_per_epoch"] == {"value": expr}
    assert "not a literal" in got["my_usd_per_epoch"]["other"]
    assert got["my_cheapest_gpus"] == {"value": 1} and got["my_fastest_gpus"] == {"value": None}
    assert got["my_best_interval_s"] == {"value": 60.5}


def test_exercises_stay_in_the_lab(tmp_path):
    """Lab 8's hook and ring all-reduce are code, run on ranks of their own: its pre-lab asks its three numbers."""
    out = tmp_path / "p.ipynb"
    assert prelab.make("labs/08_build_it_yourself.ipynb", str(out)) == ["lab08.q1", "lab08.q2", "lab08.q3"]
    code = "".join("".join(c["source"]) for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code")
    assert "def " not in code and "my_allreduce_hook" not in code


def test_a_notebook_without_answer_cells_has_no_prelab(tmp_path):
    empty = tmp_path / "12_what_does_it_cost.ipynb"
    empty.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    with pytest.raises(ValueError, match="no graded prediction"):
        prelab.make(str(empty), str(tmp_path / "p.ipynb"))
