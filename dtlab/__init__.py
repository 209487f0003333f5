"""dtlab: a hands-on lab for where distributed training spends its time.

The data path runs one way: RunConfig -> launch (torchrun) -> ranks record into a run directory ->
load_run -> DataFrames -> cost model and figures. See README.md for the definitions every lab uses.

Names are imported on first use: a rank started as `python -m dtlab.rank.worker` must not pay for pandas, scipy
and plotly before it has even set up its parent-death signal.
"""

import importlib

__version__ = "0.1.0"

_WHERE = {
    "RunConfig": "config", "ZeroConfig": "config", "tiny": "config",
    "launch": "launcher", "run": "launcher", "Handle": "launcher",
    "Run": "results", "RunFailed": "results", "load_run": "results",
    "rank_waits": "waits", "run_waits": "waits", "sync_step_model": "waits",
    "calibrate": "calibration", "Profile": "model.profile", "load_profile": "model.profile", "predict": "model.prediction", "sweep": "sweeps",
    "submit": "slurm", "Emulation": "emulate",
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
