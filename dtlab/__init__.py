"""dtlab: a hands-on lab for where distributed training spends its time.

The data path runs one way: RunConfig -> launch (torchrun) -> ranks record into a run directory ->
load_run -> DataFrames -> cost model and figures. See README.md for the definitions every lab uses.
"""

from .config import RunConfig, ZeroConfig, tiny
from .launch import Handle, launch, run
from .results import Run, RunFailed, load_run
from .calibrate import calibrate
from .fit import Profile, load_profile
from .predict import predict
from .sweep import sweep

__version__ = "0.1.0"

__all__ = ["RunConfig", "ZeroConfig", "tiny", "launch", "run", "Handle", "Run", "RunFailed", "load_run",
           "calibrate", "Profile", "load_profile", "predict", "sweep"]
