"""A submission's recordings as the autograder sees them: find the lab's runs and calibrations by config, check
them (dtlab.course.integrity) and load them, or say why not.

`Recordings(root, replay, extra)`: every finished run and calibration under `root` (the directory the notebook ran in,
or the copy of a submission handed in with its runs). The machine the lab configs are built for is the one the
recordings were made on when replaying (their launch facts: quick mode and GPU count), and this machine in quick
mode otherwise (the notebook ran here with DTLAB_QUICK=1, whatever a recording claims). `run(cfg, what)` and
`calibration(fields, what)` return the newest matching recording loaded, after its consistency checks; a missing
or inconsistent one raises `SourceProblem` with one line that names it, and the questions that need it score 0.
"""

from __future__ import annotations

import contextlib
import os

from dtlab.course.integrity import calibration_problems, run_problems
from dtlab.course.labs import lab_config, quick_mode
from dtlab.launching import replay
from dtlab.results.calibration import load_calibration
from dtlab.results.run import load_run


class SourceProblem(Exception):
    """A recording a question needs is missing or inconsistent (the message says which and why)."""


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


class Recordings:
    """The finished recordings under `root` (see the module's docstring); `used` lists the directories loaded."""

    def __init__(self, root: str, replay_mode: bool, extra=()):
        self.root, self.replay = os.path.abspath(root), replay_mode
        self.recs = replay.recorded_in(self.root)
        for d in extra:  # recordings outside root that the notebook named (the setup check's smoke test in /tmp)
            self.recs = sorted(
                self.recs + [r for r in replay.recorded_in(d) if r not in self.recs],
                key=lambda dc: (replay.launch_time(dc[1]), dc[0]),
            )
        self.used: list[str] = []
        self.problems: list[str] = []  # one line per inconsistent recording a question asked for
        self._cache: dict = {}

    def _context(self):
        return _env(
            **({replay.ENV: self.root, "DTLAB_QUICK": None} if self.replay else {replay.ENV: None, "DTLAB_QUICK": "1"})
        )

    @property
    def quick(self) -> bool:
        """Quick mode for the lab configs: the recordings' mode when replaying, else True."""
        with self._context():
            return quick_mode()

    def lab_config(self, **overrides):
        """dtlab.course.labs.lab_config(**overrides) for the machine the recordings were made on."""
        with self._context():
            return lab_config(**overrides)

    def _find(self, kind: str, fields: dict, defaults: dict | None, what: str) -> str:
        d = replay.match(self.recs, kind, fields, defaults)
        if d is None:
            why = replay.closest(self.recs, self.root, kind, fields)
            raise SourceProblem(f"{what}: no finished recording matches ({why})")
        return d

    def run(self, cfg, what: str):
        """The newest finished run of `cfg` (a RunConfig; `out` ignored), checked and loaded."""
        fields, defaults = cfg.to_dict(), type(cfg)().to_dict()
        d = self._find("config", fields, defaults, what)
        if d not in self._cache:
            run = load_run(d)
            self._cache[d] = self._problem(what, d, run_problems(run, fields, defaults)) or run
        return self._loaded(d)

    def calib_dir(self, fields: dict, what: str) -> str:
        """The newest finished calibration whose config has these `fields`, checked; its directory."""
        d = self._find("calibration", fields, None, what)
        key = ("dir", d)
        if key not in self._cache:
            self._cache[key] = self._problem(what, d, calibration_problems(d, fields)) or d
        return self._loaded(key, d)

    def calibration(self, fields: dict, what: str):
        """The newest finished calibration with these `fields`, checked and fitted again from its samples."""
        d = self.calib_dir(fields, what)
        if d not in self._cache:
            self._cache[d] = load_calibration(d)
        return self._cache[d]

    def _problem(self, what: str, d: str, problems: list[str]):
        if not problems:
            return None
        self.problems.append(f"{self._rel(d)} inconsistent: {problems[0]}")
        return SourceProblem(f"{what} ({self._rel(d)}) is inconsistent: {'; '.join(problems)}")

    def _loaded(self, key, d=None):
        got = self._cache[key]
        if isinstance(got, SourceProblem):
            raise got
        d = d or key
        if d not in self.used:
            self.used.append(d)
        return got

    def _rel(self, d: str) -> str:
        return os.path.relpath(d, self.root)
