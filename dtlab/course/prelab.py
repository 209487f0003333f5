"""Pre-labs: a lab's predictions handed in before the lab, graded against the runs of the lab handed in after.

A student can run a lab ahead of its questions (a check cell shows nothing before an answer, but a later section
may), so a prediction an instructor grades can be collected first. `make(student_nb, out)` writes the pre-lab of
a lab: its prediction cells alone (each graded question's answer cell, `my_... = None`, and the text just above
it), no code that runs anything. The student fills in numbers, choices, or strings of arithmetic on the lab's named
values (lab 12: "ceil(epoch_samples / samples_per_step) * t_step_s * devices / 3600"), and hands it in before the
lab; `dtlab assign` writes one per lab to OUT/prelab/.

Grading (`dtlab grade`, dtlab.course.batch): a pre-lab in a student's submission folder beside the lab notebook
is read, never run: `answers(path)` takes each top-level `my_... = <literal>` (a number, a string, None) from its
cells by parsing them. The grader then judges those answers with the same keys as the lab's own answers, computed
from the runs the lab notebook recorded, in rows of their own (`lab12.q1 (pre-lab)`).
"""

from __future__ import annotations

import ast
import json
import re

from dtlab.course import rubric

MARK = "prelab"  # the notebook metadata key: {"dtlab": {"prelab": LAB}}
INTRO = """# Pre-lab: {lab}

Your predictions, before you run the lab. Set each `my_...` below to a number, one of the choices, or a string of
arithmetic on the values the lab names (each question says which; `ceil`, `floor` and `sqrt` are allowed), then hand
this notebook in **before** the lab. It runs nothing: your answers are read from it as written and graded against
the runs of the lab notebook you hand in afterwards, with the same keys and tolerances as the lab's own checks."""


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def _cell(kind: str, text: str) -> dict:
    cell = {"cell_type": kind, "metadata": {}, "source": text}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def prediction_cells(nb: dict, lab: str) -> list[dict]:
    """The lab's prediction cells in order: for every graded question answered by a value (not by code of one's
    own, as lab 8's exercises are), its answer cell (the code cell assigning its variable) and the markdown cell
    just above it (the question's text), each once."""
    cells, seen = nb["cells"], set()
    for q in rubric.questions(lab):
        if "answer" in q.needs:
            continue  # an exercise: the student's code, run on ranks of its own
        pat = re.compile(rf"^\s*{re.escape(q.var)}\s*=", re.M)
        at = next((i for i, c in enumerate(cells) if c["cell_type"] == "code" and pat.search(_source(c))), None)
        if at is None:
            continue
        md = next((i for i in range(at - 1, -1, -1) if cells[i]["cell_type"] == "markdown"), None)
        seen.update({at} if md is None else {md, at})
    return [_cell(cells[i]["cell_type"], _source(cells[i])) for i in sorted(seen)]


def make(student_nb: str, out: str, lab: str | None = None) -> list[str]:
    """Write the pre-lab of the student notebook `student_nb` (lab: its name's stem unless given) to `out`; the
    qids it asks. ValueError naming the lab when it has no prediction to collect."""
    with open(student_nb, encoding="utf-8") as f:
        nb = json.load(f)
    lab = lab or re.sub(r"\.ipynb$", "", student_nb.replace("\\", "/").rsplit("/", 1)[-1])
    cells = prediction_cells(nb, lab)
    if not cells:
        raise ValueError(f"lab: {lab} has no graded prediction (its graded questions are exercises or none)")
    asked = [
        q.qid for q in rubric.questions(lab) if any(re.search(rf"^\s*{q.var}\s*=", c["source"], re.M) for c in cells)
    ]
    pre = {
        "cells": [_cell("markdown", INTRO.format(lab=lab))] + cells,
        "metadata": {**nb.get("metadata", {}), "dtlab": {MARK: lab, "questions": asked}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    for i, c in enumerate(pre["cells"]):
        c["id"] = f"prelab-{i}"
    with open(out, "w", encoding="utf-8") as f:
        f.write(json.dumps(pre, indent=1, ensure_ascii=False) + "\n")
    return asked


def prelab_of(nb_path: str) -> str | None:
    """The lab a pre-lab notebook is for (its metadata), or None for any other notebook (or an unreadable one)."""
    try:
        with open(nb_path, encoding="utf-8") as f:
            meta = (json.load(f).get("metadata") or {}).get("dtlab") or {}
        return meta.get(MARK) if isinstance(meta, dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def answers(nb_path: str) -> dict:
    """{var: entry} of a pre-lab's answers, read without running anything: every top-level `my_... = value` of its
    code cells, the last one counting; entry {"value": v} for a number, string or None, {"other": why} for anything
    else (a call, a name): the grader's export format (dtlab.course.grader.answer_of)."""
    with open(nb_path, encoding="utf-8") as f:
        nb = json.load(f)
    out = {}
    for c in nb.get("cells", []):
        if c.get("cell_type") != "code":
            continue
        try:
            tree = ast.parse(_source(c))
        except SyntaxError:
            continue
        for node in tree.body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                continue
            name = node.targets[0].id
            if not name.startswith("my_"):
                continue
            try:
                v = ast.literal_eval(node.value)
                ok = v is None or isinstance(v, (bool, int, float, str))
                out[name] = {"value": v} if ok else {"other": f"{type(v).__name__} (a pre-lab answer is a literal)"}
            except (ValueError, TypeError, SyntaxError):
                out[name] = {"other": "not a literal (a pre-lab runs nothing: write a number or a string)"}
    return out
