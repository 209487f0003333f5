"""PyTorch profiler (Kineto) traces of any job, read with dtlab's definitions: `load_trace(path)` -> `Trace`."""

from dtlab.results.kineto.reader import TraceDamaged
from dtlab.results.kineto.trace import Trace, load_trace

__all__ = ["Trace", "TraceDamaged", "load_trace"]

import os as _os

_PUBLIC = {"hta-2ranks-rank0": "hta_nccl_2ranks_rank0.json.gz", "hta-8ranks-rank3": "hta_8ranks_rank3.json.gz"}


def public_trace(name: str) -> str:
    """The path of a public trace shipped with dtlab (public-traces/README.md says where each comes from):
    'hta-2ranks-rank0' (newer layout, 2-rank job) or 'hta-8ranks-rank3' (older layout, 8-rank job)."""
    if name not in _PUBLIC:
        raise ValueError(f"name must be one of {sorted(_PUBLIC)}, got {name!r}")
    return _os.path.join(_os.path.dirname(__file__), "public-traces", _PUBLIC[name])


__all__.append("public_trace")
