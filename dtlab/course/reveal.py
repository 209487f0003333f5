"""Keys a lab shows before it asks: a scan of an executed lab for a number that gives a question's answer away.

A prediction is only a prediction if nothing printed before it answers it. For every number question of a lab,
`scan(nb, keys)` looks at what the executed notebook showed (its text outputs) in two places: every cell above the
question's answer cell (the code cell that assigns its `my_*` variable), and the question's own check cell (the
cell that calls `check("labNN.qK", ...)`), which must say "answer first" and nothing that answers it. A number
there whose value lies within the key's tolerance of the key is a finding; numbers below the answer cell (a later
section, a check's reveal after an answer) are not. A number with a unit is read in the key's unit when the two
are of one kind (`57.2 ms` is 0.0572 for a key in s, `3.9 MB` 3.9e6 for a key in B, `$0.12` for a key in USD) and
skipped otherwise; a number without one is read as written when it has at least BARE_DIGITS significant digits
(a table's `66.72`), and counts within BARE_REL of the key at most, so that the counts and other columns around a
question ("64 samples", a compute time beside a wait) do not pass for readings of its key. A key that is an exact
count (a whole number of steps, no tolerance) is read only from a number written whole: a table's ratio of
`1.00` is not 1 step.

The keys come from the lab's rubric (dtlab.course.rubric) applied to the runs the notebook recorded, as the grader
computes them (dtlab.course.recordings): `number_keys(lab, root)`, with the inputs a question gives by design (its
rubric's `given`: a prediction's inputs, another quantity of the key's unit). `python -m dtlab.course.reveal keys
--lab LAB --root DIR --out KEYS.json` computes them in a process of its own, the way `dtlab grade` does, so a
check of a lab needs no key in the process that reads the notebook; `python -m dtlab.course.reveal scan NB --lab
LAB --root DIR` does both and prints each finding.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from dtlab.course import recordings, rubric, verdicts

#: a number as the labs print it: optional sign and $, thousands separators, decimals, an exponent, then a unit
NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-+−])?(?P<usd>\$)?(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?P<exp>[eE][-+]?\d+)?(?:\s?(?P<unit>[µu]s|ms|ns|s|GiB|MiB|KiB|GB/s|MB/s|GB|MB|kB|KB|B|%)(?![\w/]))?"
)
#: a unit's kind and its factor to the kind's base (seconds, bytes, bytes per second, a fraction)
UNITS = {
    "ns": ("time", 1e-9),
    "us": ("time", 1e-6),
    "µs": ("time", 1e-6),
    "ms": ("time", 1e-3),
    "s": ("time", 1.0),
    "B": ("bytes", 1.0),
    "kB": ("bytes", 1e3),
    "KB": ("bytes", 1e3),
    "MB": ("bytes", 1e6),
    "GB": ("bytes", 1e9),
    "KiB": ("bytes", 2.0**10),
    "MiB": ("bytes", 2.0**20),
    "GiB": ("bytes", 2.0**30),
    "MB/s": ("rate", 1e6),
    "GB/s": ("rate", 1e9),
    "%": ("fraction", 1e-2),
    "USD": ("USD", 1.0),
}
#: a number printed without a unit is compared only when it has at least this many significant digits (a count such
#: as "64 samples" is not a reading of a key in seconds; "66.72" in a table of seconds is), and within BARE_REL of the
#: key at most: its unit unknown (a table's column names it), a wider match is more often another column's value (a
#: compute time of 66.7 ms beside a key of 44.6 ms whose tolerance is 50%) than a reading of the key
BARE_DIGITS = 3
BARE_REL = 0.02


def numbers_in(text: str) -> list[dict]:
    """Every number in `text`: {value (as written, sign and exponent applied), shown, kind and factor of its unit
    (None for none; USD for a leading $), digits (significant digits as written), half (half a unit in its last
    written place, in its written unit: how far from the value it stands for a printed number can be)}."""
    out = []
    for m in NUMBER.finditer(text):
        raw = float(m["num"].replace(",", "") + (m["exp"] or ""))
        kind, factor = UNITS.get("USD" if m["usd"] else m["unit"] or "", (None, 1.0))
        digits = len(m["num"].replace(",", "").replace(".", "").lstrip("0")) or 1
        decimals = len(m["num"].partition(".")[2])
        half = 0.5 * 10.0 ** (int(m["exp"][1:]) - decimals if m["exp"] else -decimals)
        value = -raw if m["sign"] in ("-", "−") else raw
        out.append(
            {
                "value": value,
                "shown": m.group(0).strip(),
                "kind": kind,
                "factor": factor,
                "digits": digits,
                "half": half,
            }
        )
    return out


def reading(number: dict, unit: str) -> float | None:
    """`number` (of numbers_in) read in a key's `unit`: converted when both units are of one kind (57.2 ms is 0.0572
    for a key in s), as written when it has no unit and BARE_DIGITS significant digits, else None (not comparable)."""
    kind, factor = UNITS.get(unit, (None, 1.0))
    if number["kind"] is None:
        return number["value"] if number["digits"] >= BARE_DIGITS else None
    if kind is not None and number["kind"] == kind:
        return number["value"] * number["factor"] / factor
    return None


def cell_text(cell) -> str:
    """The text a code cell showed: streams, the plain text of results and displays, errors."""
    parts = []
    for o in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
        text = o.get("text", "") or o.get("data", {}).get("text/plain", "") or o.get("data", {}).get("text/html", "")
        parts.append("".join(text) if isinstance(text, list) else str(text))
        if o.get("output_type") == "error":
            parts.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "\n".join(parts)


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def answer_cell(nb, var: str) -> int | None:
    """The index of the first code cell that assigns `var` at the start of a line (the question's answer cell)."""
    pat = re.compile(rf"^\s*{re.escape(var)}\s*=", re.M)
    return next((i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and pat.search(_source(c))), None)


def check_cells(nb, qid: str) -> list[int]:
    """The indices of the code cells that check `qid` (`check("qid", ...)`)."""
    pat = re.compile(rf"check\(\s*[\"']{re.escape(qid)}[\"']")
    return [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and pat.search(_source(c))]


def is_given(number: dict, value: float, unit: str, given) -> bool:
    """Whether `number` (of numbers_in; `value`, its reading in the key's `unit`) is one of the question's `given`
    inputs (in the key's unit) as printed: within half a unit of its last written place."""
    _, key_factor = UNITS.get(unit, (None, 1.0))
    half = number["half"] * (number["factor"] / key_factor if number["kind"] is not None else 1.0)
    return any(abs(value - float(g)) <= half * (1 + 1e-9) for g in given)


def scan(nb, keys: dict, skip_checks=()) -> list[dict]:
    """Findings in the executed notebook `nb` (a dict or NotebookNode) for `keys` {qid: {"var", "expected",
    "tol"}} (tol: the absolute tolerance): one {qid, cell, where, shown, key, tol} per number within tol of its
    key, above the answer cell or in a check cell of the question. A key's optional "given" (values in its unit,
    shown by design: the inputs a prediction is asked to use, or another quantity the key does not come from)
    exempts a number that prints one of them: when the model is right its input lies near the measured key, and
    that is the lesson, not a reveal. `skip_checks`: qids answered in this notebook, whose check cells may show
    what a right answer earns."""
    found = []
    for qid, k in keys.items():
        ans = answer_cell(nb, k["var"])
        if ans is None:
            raise ValueError(f"{qid}: no cell assigns its answer variable {k['var']!r}")
        places = [(i, "above its answer cell") for i in range(ans)]
        if qid not in skip_checks:
            places += [(i, "in its check cell") for i in check_cells(nb, qid) if i > ans]
        exp, tol = float(k["expected"]), float(k["tol"])
        exact_count = exp.is_integer() and tol == 0 and k.get("unit", "") not in UNITS
        for i, where in places:
            for number in numbers_in(cell_text(nb["cells"][i])):
                value = reading(number, k.get("unit", ""))
                within = tol if number["kind"] is not None else min(tol, BARE_REL * abs(exp))
                if value is None or value == 0 or abs(value - exp) > within:
                    continue
                if number["kind"] is None and exact_count and number["half"] < 0.5:
                    continue  # a count is written whole: "1.00" is a ratio or a time, not 1 step
                if not is_given(number, value, k.get("unit", ""), k.get("given", ())):
                    found.append(
                        {"qid": qid, "cell": i, "where": where, "shown": number["shown"], "key": exp, "tol": tol}
                    )
    return found


def number_keys(lab: str, root: str, replay_mode: bool = False) -> dict:
    """{"keys": {qid: {"var", "expected", "tol", "unit"}}, "problems": {qid: why}}: the keys of the lab's number
    questions, computed by its rubric from the recordings under `root` (quick mode unless `replay_mode`); a
    question whose key cannot be computed is left out of "keys", its reason in "problems"."""
    rec = recordings.Recordings(root, replay_mode=replay_mode)
    srcs = rubric.lab_module(lab).sources(rec)
    out, problems = {}, {}
    for q in rubric.questions(lab):
        if "answer" in q.needs:
            continue  # an exercise: the key is the student's own code run again
        try:
            key = rubric.key(q.qid, **{n: srcs[n]() for n in q.needs})
            given = [float(v) for v in q.given(**{n: srcs[n]() for n in q.given_needs})] if q.given else None
        except Exception as e:  # noqa: BLE001 - a key that cannot be computed is reported, not raised
            problems[q.qid] = f"{type(e).__name__}: {e}"
            continue
        if key.kind == "number":
            out[q.qid] = {
                "var": q.var,
                "expected": float(key.expected),
                "tol": verdicts.tolerance(key)[0],
                "unit": key.unit,
            }
            if given is not None:
                out[q.qid]["given"] = given
    return {"keys": out, "problems": problems}


def main(argv=None) -> int:
    """`keys`: the lab's number keys as JSON; `scan`: the keys, then every finding in an executed notebook."""
    ap = argparse.ArgumentParser(prog="python -m dtlab.course.reveal", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keys")
    k.add_argument("--out", required=True)
    s = sub.add_parser("scan")
    s.add_argument("notebook")
    for p in (k, s):
        p.add_argument("--lab", required=True)
        p.add_argument("--root", required=True, help="the folder the lab ran in (its runs/ and profiles/)")
    args = ap.parse_args(argv)
    got = number_keys(args.lab, args.root)
    if args.cmd == "keys":
        with open(args.out, "w") as f:
            json.dump(got, f)
        return 0
    with open(args.notebook, encoding="utf-8") as f:
        nb = json.load(f)
    found = scan(nb, got["keys"])
    for qid, why in got["problems"].items():
        print(f"{qid}: no key ({why})")
    for hit in found:
        print(
            f"{hit['qid']}: {hit['shown']!r} {hit['where']} (cell {hit['cell']}) is within {hit['tol']:.4g} of its key"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
