"""What a lab shows, read the way a class reads it: three faults a test can find in an executed notebook's text.

- :func:`rounded_away`: a number printed as a decimal zero ("0.0", "0.00", "-0.0"). The labs' convention: an
  exact zero prints as ``0`` (a count, a setting, no delay), so a zero with decimals is a nonzero value that
  rounding removed (a 0.05 MiB bucket cap shown as 0.0) or a negative one shown as -0.0. The lower end of an
  interval (``[0.00, 0.91]``: a fraction clipped at 0) is the one exception.
- :func:`doubled_words`: a word repeated, next to itself or across an article ("the the", "tolerance the
  tolerance"): a sentence assembled from two pieces that both said it.
- :func:`keys_before_questions`: a question's key printed in an output above the cell where the question is asked
  (where its answer variable is first set), so the student reads the answer before predicting it.

Pure: they take text or a notebook (nbformat JSON as a dict) and return what they found, one line each.
"""

from __future__ import annotations

import re

_ZERO = re.compile(r"(?<![\w.,\[-])-?0\.0+(?![\d])")
_DOUBLE = re.compile(r"(?<![\w'])([A-Za-z]{3,})(?: (?:the|a|an|of))? \1\b", flags=re.I)


def _outputs(cell) -> list[str]:
    out = []
    for o in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
        if o.get("output_type") == "stream":
            t = o.get("text", "")
        else:
            t = o.get("data", {}).get("text/plain", "")
        out.append("".join(t) if isinstance(t, list) else t)
    return out


def _line(text: str, start: int, end: int) -> str:
    a = text.rfind("\n", 0, start) + 1
    b = text.find("\n", end)
    return text[a : b if b >= 0 else len(text)].strip()


def rounded_away(text: str) -> list[str]:
    """Lines of `text` that print a decimal zero (see the module's docstring), each once."""
    found = []
    for m in _ZERO.finditer(text):
        line = _line(text, m.start(), m.end())
        if line not in found:
            found.append(line)
    return found


def doubled_words(text: str) -> list[str]:
    """The doubled words of `text` ('tolerance the tolerance', 'the the'), as found. Table columns (words
    separated by more than one space) are not sentences and are not read."""
    return [m.group(0) for m in _DOUBLE.finditer(text)]


def renderings(value: float) -> list[str]:
    """How a number key might be printed with at least three significant digits: 0.44 -> ['0.440', '0.4400'],
    4045448 -> ['4,045,448', '4045448']."""
    v = float(value)
    out = []
    if v.is_integer() and abs(v) >= 100:
        out += [f"{v:,.0f}", f"{v:.0f}"]
    for d in range(1, 5):
        r = f"{v:.{d}f}"
        digits = r.replace("-", "").replace(".", "").lstrip("0")
        if len(digits) >= 3 and r not in out:
            out.append(r)
    return out


def keys_before_questions(nb: dict, keys: dict) -> list[str]:
    """Questions whose key is printed before they are asked. nb: an executed notebook (JSON dict); keys: {answer
    variable: number key}. A question is asked in the first code cell that sets its variable (`my_x = ...`);
    every output above that cell is searched for the key's :func:`renderings`."""
    cells = nb.get("cells", [])
    found = []
    for var, value in keys.items():
        asked = next(
            (
                i
                for i, c in enumerate(cells)
                if c.get("cell_type") == "code"
                and re.search(rf"^\s*{re.escape(var)}\s*=", "".join(c.get("source", "")), flags=re.M)
            ),
            None,
        )
        if asked is None or value is None:
            continue
        for i in range(asked):
            for text in _outputs(cells[i]):
                for r in renderings(value):
                    m = re.search(rf"(?<![\d.,]){re.escape(r)}(?![\d])", text)
                    if m:
                        found.append(
                            f"{var}: its key {r} is printed in cell {i} ({_line(text, m.start(), m.end())!r}),"
                            f" before the question in cell {asked}"
                        )
                        break
    return found


def notebook_text(nb: dict) -> str:
    """Every text output of an executed notebook, in order (what :func:`rounded_away` and :func:`doubled_words`
    read)."""
    return "\n".join(t for c in nb.get("cells", []) for t in _outputs(c))
