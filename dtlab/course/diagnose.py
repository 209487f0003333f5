"""Why a student's code failed on a rank, in words: read from the rank's own log, not guessed.

A check (dtlab.course.exercises) ships the student's function as RUN_DIR/student.py and runs it on gloo
ranks. When a rank raises, aborts in native code (gloo's `EnforceNotMet` ends the process with SIGABRT before
Python can record anything) or hangs (the watchdog asks it for its stack), its log holds what a verdict needs:
the native error message and the student's frame (file student.py, a line number). This module turns that
text into sentences: the line of the student's function (and of its notebook cell) with its source, the
native message without its C++ source location, and what that message usually means in a ring or a hook.

Pure: text in, text out (no torch, no processes), so every rule is testable on a log excerpt.
"""

from __future__ import annotations

import os
import re

STUDENT_FILE = "student.py"

# 'File ".../student.py", line 14, in fn' (a Python traceback) or '... line 14 in fn' (a faulthandler dump)
_FRAME = re.compile(r'File "([^"]*)", line (\d+),? in (\S+)')
_WHAT = re.compile(r"what\(\):\s*(.+)")
_EXC = re.compile(r"^(\w+(?:Error|Exception|NotMet)): (.+)$", re.M)
_SOURCE_LOC = re.compile(r"\[(?:enforce fail at )?/[^\]]*:\d+\]\s*")

#: known native messages -> what they mean for the student's code (matched case-insensitively)
KNOWN = (
    (
        r"Received data size doesn't match expected size",
        "a send and the recv that took it disagree on the size: the peer sent {got} where this rank's recv "
        "expected {want}. Check which chunk each rank sends and which it receives at this step: with "
        "tensor_split, chunks differ in size when p does not divide n, so an off-by-one index shows up as a "
        "size mismatch",
    ),
    (
        r"Unable to cast \[",
        "the hook's future holds a list of tensors (what work.get_future() gives); DDP needs a future whose "
        "value is one tensor: return work.get_future().then(lambda fut: fut.value()[0])",
    ),
)
#: errors a rank gets only because its peer died first (the peer's own error is the one to report)
CONSEQUENCE = r"Connection reset by peer|Connection closed by peer|Broken pipe"


def student_frame(log_text: str, filename: str = STUDENT_FILE) -> int | None:
    """The innermost line of `filename` in the last traceback or stack dump of a rank's log, or None.

    A Python traceback lists the innermost frame last; faulthandler's dump ("most recent call first") lists
    it first: each block is read in its own order."""
    blocks = re.split(
        r"\n(?=Traceback \(most recent call last\)|(?:Current thread|Thread) 0x|Fatal Python error)", log_text or ""
    )
    for block in reversed(blocks):
        frames = [(f, int(n)) for f, n, _ in _FRAME.findall(block) if os.path.basename(f) == filename]
        if not frames:
            continue
        recent_first = "most recent call first" in block or block.lstrip().startswith(("Thread 0x", "Current thread"))
        return frames[0][1] if recent_first else frames[-1][1]
    return None


def native_error(log_text: str) -> str | None:
    """The error a rank died of, one line, without C++ source locations: gloo's `what():` message of an
    abort, else the last Python exception line. None when the log has neither."""
    text = log_text or ""
    what = _WHAT.findall(text)
    if what:
        return _SOURCE_LOC.sub("", what[-1]).strip()
    exc = _EXC.findall(text)
    if exc:
        name, msg = exc[-1]
        return f"{name}: {_SOURCE_LOC.sub('', msg).strip()}"
    return None


def meaning(message: str | None) -> str | None:
    """What a native or Python error message usually means in a student's ring or hook; None if unknown."""
    if not message:
        return None
    for pattern, text in KNOWN:
        if re.search(pattern, message, flags=re.I):
            if "{got}" in text:
                m = re.search(r"(\d+) vs (\d+)", message)
                got, want = (f"{m.group(1)} B", f"at most {m.group(2)} B") if m else ("more bytes", "fewer")
                return text.format(got=got, want=want)
            return text
    return None


def is_consequence(message: str | None) -> bool:
    """True for errors a rank gets only because its peer died (the peer is the one to report)."""
    return bool(message) and bool(re.search(CONSEQUENCE, message, flags=re.I))


def source_line(student_source: str, line: int) -> str:
    """Line `line` (1-based) of student.py, stripped, without a trailing comment; '' outside the file."""
    lines = (student_source or "").splitlines()
    text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    code, sep, _ = text.rpartition("  #")
    return code.rstrip() if sep and code.count('"') % 2 == 0 and code.count("'") % 2 == 0 else text


def where(
    student_source: str,
    line: int | None,
    def_line: int | None,
    cell_line: int | None,
    name: str,
    written_in: str = "its cell",
) -> str:
    """'line 9 of my_ring (line 10 of its cell): `dist.recv(incoming, left)`' for a student.py line, or ''.
    def_line: the line of `def` in student.py; cell_line: the line of `def` where the student wrote it (the
    function's co_firstlineno), when known; written_in: 'its cell' or the file's name."""
    if line is None:
        return ""
    text = source_line(student_source, line)
    if def_line is None or line < def_line:
        return f"student.py line {line}" + (f": `{text}`" if text else "")
    in_fn = line - def_line + 1
    in_cell = f" (line {cell_line + in_fn - 1} of {written_in})" if cell_line else ""
    return f"line {in_fn} of {name}{in_cell}" + (f": `{text}`" if text else "")


def failure_feedback(
    exercise: str,
    state: str,
    logs: dict,
    student_source: str,
    name: str,
    *,
    def_line: int | None = None,
    cell_line: int | None = None,
    written_in: str = "its cell",
    culprit: int | None = None,
    signal: str | None = None,
    error: str | None = None,
    stall_s: float | None = None,
    hung_at: str = "",
) -> str:
    """One verdict sentence for a check whose ranks raised, aborted or hung.

    logs: rank -> the text of its log (RUN_DIR/logs/rank{r}.log); state: RunFailed.state ('failed',
    'stalled', 'timeout', ...); culprit, signal, error: what the launcher found (RunFailed.rank, .signal,
    .error), used when the logs say less; hung_at: where the checks had got to (e.g. ' checking n=65,537
    elements'), for a hang and for a failure alike."""

    def at(text):
        return where(student_source, student_frame(text), def_line, cell_line, name, written_in)

    if state in ("stalled", "timeout"):
        waiting = [f"rank {r} at {at(t)}" for r, t in sorted(logs.items()) if at(t)]
        limit = f" after {stall_s:g} s without progress" if stall_s and state == "stalled" else ""
        return (
            f"{exercise}: the ranks hung{hung_at} and were stopped{limit}"
            + (f": {'; '.join(waiting)}" if waiting else "")
            + ". A blocking send returns only once its peer receives: if every rank sends first, all of them "
            "wait in a circle. Use req = dist.isend(...), then dist.recv(...), then req.wait()."
        )
    errors = {r: native_error(t) for r, t in logs.items()}
    ranks = ([culprit] if culprit in logs else []) + sorted(r for r in logs if r != culprit)
    cause = next((r for r in ranks if errors.get(r) and not is_consequence(errors[r])), culprit)
    message = errors.get(cause) or error or "no error message was recorded"
    line = at(logs.get(cause, ""))
    how = f" ({signal})" if signal and cause == culprit else ""
    out = f"{exercise}: rank {cause} failed{how}{hung_at}" + (f" at {line}" if line else "") + f": {message}"
    out = out if out.rstrip()[-1:] in ".?!" else out.rstrip() + "."
    hint = meaning(message)
    return out + (f" {hint[0].upper()}{hint[1:]}." if hint else "")
