"""Which NCCL library the ranks load, and that library's own version. Pure: ctypes and psutil, no torch.

`torch.cuda.nccl.version()` is the NCCL *header* torch was compiled with: torch 2.11 reports (2, 28, 9) whatever
libnccl.so.2 its process has loaded. The library's own version is `ncclGetVersion(int *)`, read here through
ctypes. Its code is major*10000 + minor*100 + patch since NCCL 2.9 (23007 is 2.30.7) and major*1000 + minor*100 +
patch before (2804 is 2.8.4).

- `library_version(path)`: the version of one libnccl file (ValueError naming the file when it is not one).
- `loaded_library()`: the libnccl this process uses: the `ncclGetVersion` that global symbol lookup finds (a
  preloaded library comes first there), else a libnccl mapped into the process (its memory maps; torch maps its
  own on import).
- `ranks_library()`: the library the ranks will load: `DTLAB_NCCL_LIBRARY` (validated), else a libnccl named in
  LD_PRELOAD, else `loaded_library()`; None when there is none.
- `preload_env(environ)`: what the launcher adds to NCCL ranks' environment when `DTLAB_NCCL_LIBRARY` is set
  (LD_PRELOAD with the library first, and `DTLAB_NCCL_PRELOADED` naming it).
- `check_preloaded(environ)`: in a rank, the library actually loaded must be the one preloaded (RuntimeError
  otherwise, before any step).
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

import psutil

#: The environment variable naming the libnccl.so.2 the ranks must load (an NCCL newer than torch's own).
ENV = "DTLAB_NCCL_LIBRARY"
#: Set by the launcher beside LD_PRELOAD for NCCL ranks: the library each rank checks it has loaded.
PRELOADED = "DTLAB_NCCL_PRELOADED"
#: Where each source of `ranks_library` comes from, in words.
SOURCES = {
    ENV: f"named by {ENV}",
    "LD_PRELOAD": "named in LD_PRELOAD",
    "loaded": "the libnccl this process has loaded (preloaded, or torch's own)",
}
# Files this module loaded by path to read their version: never taken for the library the process itself uses.
_OPENED: set[str] = set()


def decode(code: int) -> tuple[int, int, int]:
    """An `ncclGetVersion` code as (major, minor, patch): 23007 -> (2, 30, 7) (NCCL >= 2.9), 2804 -> (2, 8, 4)."""
    code = int(code)
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


@dataclass(frozen=True)
class NcclLibrary:
    """One libnccl: its file, its `ncclGetVersion` code and where it was found (a key of SOURCES)."""

    path: str
    code: int
    source: str

    @property
    def version(self) -> tuple[int, int, int]:
        """(major, minor, patch) of the code."""
        return decode(self.code)

    @property
    def text(self) -> str:
        """The version as '2.30.7'."""
        return ".".join(map(str, self.version))

    def to_dict(self) -> dict:
        """JSON-safe: path, version ('2.30.7'), code (ncclGetVersion's), source and its words."""
        return {
            "path": self.path,
            "version": self.text,
            "code": self.code,
            "source": self.source,
            "from": SOURCES.get(self.source, self.source),
        }


def _call_version(fn, where: str) -> int:
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_int
    v = ctypes.c_int(0)
    rc = fn(ctypes.byref(v))
    if rc != 0 or v.value <= 0:
        raise ValueError(f"{where}: ncclGetVersion returned {rc} with code {v.value}")
    return v.value


def library_code(path: str) -> int:
    """`ncclGetVersion`'s code of the libnccl file `path`, loaded through ctypes (a file already loaded is not loaded
    again). ValueError naming the file when it is missing, cannot be loaded, or has no ncclGetVersion."""
    if not os.path.isfile(path):
        raise ValueError(f"{path!r}: no such file")
    real = os.path.realpath(path)
    mapped = any(os.path.realpath(p) == real for _, _, p in _maps())  # loaded already (torch's own): not ours
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ValueError(f"{path!r} cannot be loaded as a shared library ({e})") from None
    if not mapped:
        _OPENED.add(real)
    fn = getattr(lib, "ncclGetVersion", None)
    if fn is None:
        raise ValueError(f"{path!r} has no ncclGetVersion: not an NCCL library")
    return _call_version(fn, repr(path))


def library_version(path: str) -> tuple[int, int, int]:
    """(major, minor, patch) of the libnccl file `path` (`library_code`, decoded); ValueError if it is not one."""
    return decode(library_code(path))


def _maps() -> list[tuple[int, int, str]]:
    """(start, end, file) of every file mapping of this process (psutil's memory maps, ungrouped)."""
    out = []
    try:
        maps = psutil.Process().memory_maps(grouped=False)
    except (psutil.Error, OSError, AttributeError):  # AttributeError: a system psutil lists no maps for
        return out
    for m in maps:
        if m.path.startswith("/") and "-" in getattr(m, "addr", ""):
            lo, hi = m.addr.split("-")
            out.append((int(lo, 16), int(hi, 16), m.path))
    return out


def mapped_nccl() -> list[str]:
    """The libnccl files this process has mapped, in the order first seen."""
    seen: list[str] = []
    for _, _, path in _maps():
        if os.path.basename(path).startswith("libnccl") and path not in seen:
            seen.append(path)
    return seen


def loaded_library() -> NcclLibrary | None:
    """The libnccl this process uses, or None: the file holding the `ncclGetVersion` that global symbol lookup finds
    (what torch's calls bind to; an LD_PRELOAD library precedes every other), else the first libnccl mapped in
    this process's memory maps that this module did not load itself to read a version."""
    fn = getattr(ctypes.CDLL(None), "ncclGetVersion", None)
    if fn is not None:
        addr = ctypes.cast(fn, ctypes.c_void_p).value or 0
        path = next((p for lo, hi, p in _maps() if lo <= addr < hi), "?")
        return NcclLibrary(path, _call_version(fn, "this process's ncclGetVersion"), "loaded")
    for path in mapped_nccl():
        if os.path.realpath(path) in _OPENED:
            continue
        try:
            return NcclLibrary(path, library_code(path), "loaded")
        except ValueError:
            continue
    return None


def requested_library(environ=None) -> NcclLibrary | None:
    """The library `DTLAB_NCCL_LIBRARY` names (None when unset or empty). ValueError naming the variable when it does
    not name an NCCL library file."""
    environ = os.environ if environ is None else environ
    raw = (environ.get(ENV) or "").strip()
    if not raw:
        return None
    path = os.path.abspath(raw)
    if re.search(r"[:\s]", path):
        raise ValueError(
            f"{ENV} must be the path of an NCCL library file without spaces or colons (LD_PRELOAD, which carries it "
            f"to the ranks, splits paths at them), got {raw!r}"
        )
    try:
        return NcclLibrary(path, library_code(path), ENV)
    except ValueError as e:
        raise ValueError(
            f"{ENV} must be the path of an NCCL library file (libnccl.so.2, whose ncclGetVersion gives its "
            f"version), or unset to use the NCCL torch loads; got {raw!r}: {e}"
        ) from None


def preloaded_paths(environ=None) -> list[str]:
    """The files LD_PRELOAD names (separated by colons or spaces), in order; names without a slash are left out."""
    environ = os.environ if environ is None else environ
    return [p for p in re.split(r"[:\s]+", environ.get("LD_PRELOAD", "")) if "/" in p]


def ranks_library(environ=None) -> NcclLibrary | None:
    """The NCCL library the ranks will load: `DTLAB_NCCL_LIBRARY` (ValueError if it names no NCCL library), else the
    first libnccl in LD_PRELOAD that has ncclGetVersion, else the one this process has loaded (`loaded_library`:
    call it after importing torch), else None."""
    environ = os.environ if environ is None else environ
    asked = requested_library(environ)
    if asked is not None:
        return asked
    for path in preloaded_paths(environ):
        if os.path.basename(path).startswith("libnccl"):
            try:
                return NcclLibrary(path, library_code(path), "LD_PRELOAD")
            except ValueError:
                continue
    return loaded_library()


def preload_env(environ=None) -> dict:
    """What NCCL ranks' environment gets when `DTLAB_NCCL_LIBRARY` is set ({} when it is not): LD_PRELOAD with that
    library first (the rest kept after it) and `DTLAB_NCCL_PRELOADED` naming it, which each rank checks
    (`check_preloaded`). ValueError naming the variable when it names no NCCL library."""
    environ = os.environ if environ is None else environ
    lib = requested_library(environ)
    if lib is None:
        return {}
    rest = [p for p in re.split(r"[:\s]+", environ.get("LD_PRELOAD", "")) if p and p != lib.path]
    return {"LD_PRELOAD": ":".join([lib.path, *rest]), PRELOADED: lib.path}


def check_preloaded(environ=None) -> NcclLibrary | None:
    """In a rank: when the launcher preloaded a library (`DTLAB_NCCL_PRELOADED`), the library this process uses
    (`loaded_library`, read first) must be that file, at that file's version; returns it. RuntimeError saying
    which library was asked for and which is loaded otherwise. None when nothing was preloaded."""
    environ = os.environ if environ is None else environ
    want = environ.get(PRELOADED)
    if not want:
        return None
    loaded = loaded_library()
    try:
        asked = library_code(want)
    except ValueError as e:
        raise RuntimeError(f"{ENV}: the library preloaded into this rank is no longer readable: {e}") from None
    same = loaded is not None and os.path.realpath(loaded.path) == os.path.realpath(want) and loaded.code == asked
    if not same:
        found = (
            "no NCCL library is loaded (LD_PRELOAD did not take effect)"
            if loaded is None
            else f"the loaded NCCL is {loaded.path} ({loaded.text}, ncclGetVersion {loaded.code})"
        )
        raise RuntimeError(
            f"{ENV} asked for {want} ({'.'.join(map(str, decode(asked)))}, ncclGetVersion {asked}), but {found}: "
            f"this rank stops before its first step. LD_PRELOAD={environ.get('LD_PRELOAD', '')!r}"
        )
    return loaded
