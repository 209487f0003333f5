"""dtlab: a hands-on lab for where distributed training spends its time.

The data path runs one way: RunConfig -> launch (torchrun) -> ranks record into a run directory ->
load_run -> DataFrames -> cost model and figures. The definitions every lab uses are in README.md and
docs/measurement.md.

Names are imported on first use: a rank started as `python -m dtlab.rank.worker` must not pay for pandas, scipy
and plotly before it has even set up its parent-death signal.

Messages from the library (a run replayed, a shutdown that crashed after every rank finished, a GPU held by another
run) go through `logging.getLogger("dtlab")`: silence them with its level (`logging.getLogger("dtlab").setLevel(
logging.ERROR)`) or route them with a handler of your own. Until the program configures logging (the root logger
has no handler), they are printed as before: information on stdout, warnings on stderr, the streams of the moment
(a notebook cell's or the command line's).
"""

import importlib
import logging
import sys

__version__ = "0.1.0"


class _Console(logging.Handler):
    """Prints dtlab's messages while the program has configured no logging of its own (else the root's handlers
    have them, through propagation): below WARNING on stdout, WARNING and above on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            print(self.format(record), file=sys.stdout if record.levelno < logging.WARNING else sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's own rule: a message that cannot be printed does not raise
            self.handleError(record)


_LOG = logging.getLogger("dtlab")
if not any(isinstance(h, _Console) for h in _LOG.handlers):
    _LOG.addHandler(_Console())
if _LOG.level == logging.NOTSET:
    _LOG.setLevel(logging.INFO)

_WHERE = {
    "RunConfig": "config.run",
    "ZeroConfig": "config.run",
    "tiny": "config.run",
    "CalibConfig": "config.calibration",
    "launch": "launching.handle",
    "run": "course.watching",
    "Handle": "launching.handle",
    "calibrate": "launching.calibration",
    "sweep": "launching.sweeps",
    "submit": "launching.slurm",
    "Emulation": "launching.emulate",
    "Run": "results.run",
    "load_run": "results.run",
    "RunFailed": "results.status",
    "rank_waits": "results.stragglers",
    "run_waits": "results.stragglers",
    "sync_step_model": "results.stragglers",
    "Profile": "model.profile",
    "load_profile": "results.calibration",
    "predict": "model.prediction",
    "load_nccl_tests": "results.nccl_profile",
    "public_nccl_tests": "results.nccl_profile",
    "whatif": "results.whatif",
    "WhatIf": "results.whatif",
    "Link": "model.link",
    "TwoLevelLink": "model.link",
    "recorded_runs": "results.recorded",
    "recorded_run": "results.recorded",
    "recorded_calibration": "results.recorded",
    "load_trace": "results.kineto",
    "Trace": "results.kineto",
    "public_trace": "results.kineto",
    "cost": "results.cost",
    "PriceTable": "model.cost",
    "GpuPrice": "model.cost",
    "example_prices": "model.cost",
    "spot_plan": "model.spot",
}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtlab' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
