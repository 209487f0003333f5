"""Replay: grade a notebook from the run directories it produced, without running anything again.

A student who ran a lab on a GPU machine hands in the notebook together with the `runs/` and `profiles/`
directories it wrote. At grading time, on a CPU machine, `DTLAB_REPLAY=SUBMISSION_DIR` (set by `dtlab grade`)
makes the notebook see the machine it was recorded on and load its runs instead of launching:

- `recorded_machine()`: quick mode and GPU count as the recorded runs saw them (every launch records both in
  its config.json under "launch"), so `dtlab.course.labs.lab_config()` builds the very configs the student ran;
- `find(kind, fields)`: the newest finished run (kind "config") or calibration (kind "calibration") in the
  submission whose recorded config has the same value for every field the notebook set, or None;
- `Replayed`: what `dtlab.launch` / `dtlab.launching.calibration.launch_calibration` return instead of a Handle: already
  finished, `wait()` / `result()` load the recorded directory.

A config with no recorded match raises ReplayMissing, naming the fields and the recorded runs, rather than
training on the grader's machine. Without DTLAB_REPLAY nothing here is used.
"""

from __future__ import annotations

import glob
import json
import logging
import os

from dtlab.results.status import recorded_status
from dtlab.results.upgrade import upgrade_doc

_LOG = logging.getLogger(__name__)

ENV = "DTLAB_REPLAY"
LOG_ENV = "DTLAB_REPLAY_LOG"  # set by `dtlab grade`: one JSON line per recording loaded or missing


def _log(**entry) -> None:
    """Tell the grader what this notebook replayed (or lacked), when it asked (DTLAB_REPLAY_LOG)."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


class ReplayMissing(RuntimeError):
    """The notebook asked for a run the submission does not contain."""


def replay_root() -> str | None:
    """The submission directory being replayed (DTLAB_REPLAY), or None when not replaying."""
    root = os.environ.get(ENV, "").strip()
    return os.path.abspath(root) if root else None


def status_of(run_dir: str, cfg: dict) -> dict:
    """A recording's status.json; for a multi-node one (nnodes > 1 in its config), the nodes' merged status."""
    nnodes = int(cfg.get("nnodes") or 1) if isinstance(cfg, dict) else 1
    return recorded_status(run_dir, nnodes)[0] or {}


def recorded_in(root: str) -> list[tuple[str, dict]]:
    """(run directory, config.json) of every finished run or calibration under `root` (recursively), oldest
    first by launch time."""
    out = []
    for cfg_path in sorted(glob.glob(os.path.join(root, "**", "config.json"), recursive=True)):
        d = os.path.dirname(cfg_path)
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(cfg, dict):
            continue
        if isinstance(cfg.get("config"), dict):  # a run recorded by any dtlab, in today's form
            try:
                cfg = upgrade_doc(cfg)[0]
            except ValueError:
                continue
        inner = cfg.get("config") or cfg.get("calibration") or {}
        if status_of(d, inner).get("state") == "finished":
            out.append((d, cfg))
    return sorted(out, key=lambda dc: (launch_time(dc[1]), dc[0]))


def launch_time(cfg: dict) -> float:
    t = cfg.get("launch", {}).get("time", 0.0) if isinstance(cfg.get("launch"), dict) else 0.0
    return float(t) if isinstance(t, (int, float)) else 0.0


_recorded = recorded_in


def recorded_machine() -> dict | None:
    """{"quick": bool, "gpus": int} of the machine the submission's runs were recorded on (from the newest
    run that recorded them), or None when not replaying or nothing recorded them."""
    root = replay_root()
    if root is None:
        return None
    for _, cfg in reversed(_recorded(root)):
        launch = cfg.get("launch", {})
        if "quick" in launch and "gpus" in launch:
            return {"quick": bool(launch["quick"]), "gpus": int(launch["gpus"])}
    return None


def _same(want, got) -> bool:
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(want) == len(got) and all(_same(a, b) for a, b in zip(want, got))
    if isinstance(want, float) or isinstance(got, float):
        try:
            return abs(float(want) - float(got)) <= 1e-9 * max(1.0, abs(float(want)))
        except (TypeError, ValueError):
            return False
    return want == got


def field_same(k, v, rec: dict, defaults: dict | None) -> bool:
    """Field k asked as v matches the recording: equal to its recorded value, or, for a field the recording
    predates (dtlab gained it later), equal to the field's default, which is how that run behaved."""
    if k in rec:
        return _same(v, rec[k])
    return defaults is not None and k in defaults and _same(v, defaults[k])


RUN_SPECIFIC = ("out", "rdzv_endpoint", "rdzv_id")  # where and how one launch met: never part of what was run


def flat_fields(fields: dict | None) -> dict | None:
    """A config dict with each option group's fields as their own entries ("ddp.bucket_mb"), so that recordings are
    compared, and their differences named, field by field."""
    if fields is None:
        return None
    out = {}
    for k, v in fields.items():
        if isinstance(v, dict):
            out.update({f"{k}.{f}": x for f, x in v.items()})
        else:
            out[k] = v
    return out


def _wanted(fields: dict) -> dict:
    return {k: v for k, v in flat_fields(fields).items() if k not in RUN_SPECIFIC}


def match(recs, kind: str, fields: dict, defaults: dict | None = None) -> str | None:
    """The newest of `recs` ((directory, config.json) pairs, oldest first) of `kind` ("config" for runs,
    "calibration") whose every field in `fields` (None included: a run without a straggler is not a straggler run;
    the output directory and rendezvous endpoint ignored) equals the recorded value (`defaults`: the config's
    default values, for fields a recording predates)."""
    want, defaults = _wanted(fields), flat_fields(defaults)
    for d, cfg in reversed(list(recs)):
        rec = cfg.get(kind)
        if isinstance(rec, dict) and all(field_same(k, v, flat_fields(rec), defaults) for k, v in want.items()):
            return d
    return None


def find(kind: str, fields: dict, defaults: dict | None = None) -> str | None:
    """The newest finished recording under the replay root that matches (see `match`), or None."""
    root = replay_root()
    return None if root is None else match(_recorded(root), kind, fields, defaults)


def require(kind: str, fields: dict, defaults: dict | None = None) -> str:
    """`find`, or ReplayMissing naming what differs from the closest recording."""
    d = find(kind, fields, defaults)
    if d is not None:
        _log(kind=kind, run_dir=d)
        return d
    try:
        _missing(kind, fields)
    except ReplayMissing as e:
        _log(kind=kind, missing=str(e))
        raise


def closest(recs, root: str, kind: str, fields: dict) -> str:
    """Why no recording of `recs` matches `fields`: none of that kind, or the closest one and its differing fields."""
    want = _wanted(fields)
    recs = [(d, flat_fields(c[kind])) for d, c in recs if isinstance(c.get(kind), dict)]
    if not recs:
        return f"no finished {kind} recording at all"
    d, rec = min(reversed(recs), key=lambda dr: sum(not _same(v, dr[1].get(k)) for k, v in want.items()))
    diff = ", ".join(f"{k}: asked {v!r}, recorded {rec.get(k)!r}" for k, v in want.items() if not _same(v, rec.get(k)))
    return f"the closest, {os.path.relpath(d, root)}, differs in {diff}"


def _missing(kind: str, fields: dict) -> None:
    root = replay_root()
    recs = _recorded(root)
    if not any(isinstance(c.get(kind), dict) for _, c in recs):
        raise ReplayMissing(
            f"replay ({ENV}={root}): the submission holds no finished {kind} recording; "
            f"hand in the runs/ and profiles/ directories the notebook wrote"
        )
    raise ReplayMissing(
        f"replay ({ENV}={root}): no finished {kind} recording matches this notebook's; "
        + closest(recs, root, kind, fields)
    )


class Replayed:
    """A recorded run standing in for a launch: already finished; `wait()` and `result()` load it."""

    def __init__(self, run_dir: str, loader):
        self.run_dir, self._loader = run_dir, loader

    def status(self) -> str:
        """Always 'finished': the run was recorded."""
        return "finished"

    def wait(self, progress: bool = True, poll_s: float = 0.2):
        """The recorded result (loaded from the run directory; nothing runs)."""
        if progress:
            _LOG.info(f"replayed from {self.run_dir} (recorded; not run again)")
        return self._loader(self.run_dir)

    def result(self):
        """The recorded result."""
        return self._loader(self.run_dir)

    def stop(self, grace_s: float = 0.0) -> None:
        """Nothing to stop."""

    def rank_pids(self) -> list[int]:
        """No live ranks."""
        return []
