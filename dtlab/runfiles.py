"""The JSON files of a run directory: written so that a full disk leaves no half file and no temporary file,
read so that damage is named. Pure (no torch): the launcher, the agent's shim, the ranks and the readers use it.

- `dump_json(obj, path)` writes JSON atomically (a temporary file, then a rename), so a reader never sees half a
  file, and never leaves the temporary file behind. When the disk is full (ENOSPC, or EDQUOT: over quota) and
  `path` already exists with room for the new text in the space it holds (a status file rewritten at the end
  of a run), it is rewritten in place instead, which needs no new block; otherwise it raises `DiskFull`.
- `DiskFull` (an OSError with the same errno) names the file and the filesystem: its mount point, type, and how
  much of it is free.
- `read_json(path)`: a JSON object file read whole, or `DamagedRun` naming the file, line, column and what is
  wrong (never a bare JSONDecodeError). `RunDamageWarning`: the warning category for recoverable damage.
- `looks_full(path)`: whether the filesystem holding `path` has (almost) no space left: how the launcher tells
  a rank that died of a full disk, whose own report could not be written.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

import psutil

from dtlab.units import fmt_bytes

DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_BELOW = 64 * 1024  # bytes: less than this free on the run directory's filesystem counts as full
RANK_EXIT_DISK_FULL = errno.ENOSPC  # the exit code of a rank stopped by a full disk (dtlab.rank.lifecycle)


def is_disk_error(exc: BaseException) -> bool:
    """True for an OSError that says the disk is full or the quota is used up."""
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the filesystem holding `path` (or its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    while not os.path.ismount(p):
        p = os.path.dirname(p)
    fstype = "?"
    try:
        for part in psutil.disk_partitions(all=True):
            if part.mountpoint == p:
                fstype = part.fstype  # the last entry for a mount point is the one on top
    except (OSError, RuntimeError):
        pass
    return p, fstype


def space(path: str) -> tuple[int, int] | None:
    """(bytes free to this process, total bytes) of the filesystem holding `path`; None if unknown. Root may
    use the blocks kept back for it, so for root free counts those too."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return free * st.f_frsize, st.f_blocks * st.f_frsize


def disk_sentence(path: str) -> str:
    """'the disk holding PATH is full: tmpfs at /mnt/x, 0 B free of 2 MiB' (what is known of it)."""
    mount, fstype = mount_of(path)
    sp = space(path)
    room = f", {fmt_bytes(sp[0])} free of {fmt_bytes(sp[1])}" if sp else ""
    return f"the disk holding {path} is full: {fstype} at {mount}{room}"


def looks_full(path: str) -> bool:
    """True when the filesystem holding `path` has less than FULL_BELOW bytes free."""
    sp = space(path)
    return sp is not None and sp[0] < FULL_BELOW


class DamagedRun(ValueError):
    """A run directory that cannot be read: `path` (the file or folder), `line` (1-based, or None) and `what`."""

    def __init__(self, path: str, what: str, line: int | None = None):
        where = f"{path}, line {line}" if line is not None else path
        super().__init__(f"{where}: {what}")
        self.path, self.what, self.line = path, what, line


class RunDamageWarning(UserWarning):
    """Recoverable damage in a run directory: skipped lines, a damaged status, a rank cut short."""


def read_json(path: str) -> dict:
    """A JSON object file of a run directory, or DamagedRun naming the file, line, column and what is wrong."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
    except UnicodeDecodeError as e:
        raise DamagedRun(path, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        if not raw.strip():
            raise DamagedRun(path, "an empty file") from None
        raise DamagedRun(path, f"column {e.colno}: not JSON ({e.msg})", e.lineno) from None
    if not isinstance(doc, dict):
        raise DamagedRun(path, f"a JSON {type(doc).__name__.replace('list', 'array')}, not an object")
    return doc


class DiskFull(OSError):
    """A write in a run directory refused for lack of space (ENOSPC) or quota (EDQUOT). `path`: the file."""

    def __init__(self, path: str, cause: OSError | None = None):
        code = cause.errno if cause is not None and cause.errno else errno.ENOSPC
        super().__init__(code, os.strerror(code), path)
        self.path, self.sentence = (
            path,
            f"{disk_sentence(path)} (writing {os.path.basename(path)} failed: {os.strerror(code)})",
        )

    def __str__(self) -> str:
        return self.sentence


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _in_place(data: bytes, path: str) -> bool:
    """Rewrite `path` in the space it already holds (no new block needed); False when it holds too little."""
    try:
        st = os.stat(path)
        if st.st_blocks * 512 < len(data):
            return False
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate()
        return True
    except OSError:
        return False


def dump_json(obj: Any, path: str) -> None:
    """Write JSON atomically (write then rename), so a reader never sees half a file; no temporary file is
    left behind. On a full disk, rewrite an existing `path` in place when it has the room, else raise DiskFull."""
    data = json.dumps(obj, indent=2, default=str).encode()
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        if not is_disk_error(e):
            raise
        if not _in_place(data, path):
            raise DiskFull(path, e) from e
