"""What the course shows in a cell's output, and the records it reads back from a notebook file.

A record is a JSON object stored under a MIME type of its own (`application/vnd.dtlab.answer+json` for an answer's
verdict, dtlab.course.checks; `application/vnd.dtlab.claim+json` for a claim, dtlab.course.claims) beside the text a
person reads (``text/plain``, and ``text/html`` where there is one). Outside IPython the text is printed, followed by
one line `PREFIX {json}`. :func:`show` writes a record either way; :func:`read` reads every record of one kind back,
in cell order, from the outputs of an executed notebook. :func:`display_bundle` shows anything else (a lab's
passage, dtlab.course.wording).
"""

from __future__ import annotations

import json


def display_bundle(bundle: dict) -> bool:
    """Display a MIME bundle ({mime type: data}) as it is, in IPython; False, and nothing shown, outside it."""
    try:  # IPython only when something is displayed: a script or a grader's process may not have it
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return False
    if get_ipython() is None:
        return False
    display(bundle, raw=True)
    return True


def show(record: dict, *, mime: str, prefix: str, text: str, html: str | None = None) -> None:
    """Display `record` under `mime` with `text` (and `html`) in IPython; outside it, print `text` and then one
    line `prefix` + the record's JSON."""
    bundle = {mime: record, "text/plain": text}
    if html is not None:
        bundle["text/html"] = html
    if not display_bundle(bundle):
        print(text)
        print(prefix + json.dumps(record))


def read(notebook_path, *, mime: str, prefix: str, required: str) -> list[dict]:
    """Every record of one kind in an executed notebook's outputs, in cell order: the `mime` data of display_data
    and execute_result outputs, and the `prefix {json}` lines of stream outputs. A line that does not parse as a
    JSON object holding the key `required` is skipped (it only looks like a record)."""
    with open(notebook_path, encoding="utf-8") as f:
        nb = json.load(f)
    out = []
    for cell in nb.get("cells", []):
        for o in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = o.get("data", {})
            if mime in data:
                d = data[mime]
                out.append(json.loads(d) if isinstance(d, str) else dict(d))
            elif o.get("output_type") == "stream":
                text = o.get("text", "")
                out += _stream_records("".join(text) if isinstance(text, list) else text, prefix, required)
    return out


def _stream_records(text: str, prefix: str, required: str) -> list[dict]:
    """The `prefix {json}` lines of a stream's text that parse as a JSON object holding `required`."""
    out = []
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            rec = json.loads(line[len(prefix) :])
        except ValueError:
            continue
        if isinstance(rec, dict) and required in rec:
            out.append(rec)
    return out
