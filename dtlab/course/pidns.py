"""The end of a bubblewrap sandbox: its pid namespace, from what `bwrap --info-fd` reports.

bubblewrap exits as soon as the sandboxed command has, while its own init (pid 1 of the sandbox's pid namespace)
is still being killed and, with it, every process the command left behind; until then such a process can still
write into the outbox. `emptied` waits for the namespace to end, and ends it after a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time


def read_info(fd: int, timeout_s: float = 5.0) -> dict:
    """bubblewrap's --info-fd document ({} when it wrote none: it did not start)."""
    data, end = b"", time.monotonic() + timeout_s
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            break
        data += chunk
    try:
        return json.loads(data) if data.strip() else {}
    except ValueError:
        return {}


def emptied(info: dict, timeout_s: float = 10.0) -> bool:
    """Wait until the pid namespace bubblewrap reported (`info`: "child-pid", its init's pid here, and
    "pid-namespace") has ended: bubblewrap itself exits as soon as the sandboxed command has, while its init and
    any process the command left behind are still being killed, so a left-behind process could still write into
    the outbox. After `timeout_s` the init is killed, which ends every process in the namespace. True when it
    ended by itself (or there was none), False when it had to be killed."""
    pid, ns = info.get("child-pid"), info.get("pid-namespace")
    if not pid or not ns:
        return True
    end = time.monotonic() + timeout_s
    while in_namespace(pid, ns):
        if time.monotonic() > end:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while in_namespace(pid, ns) and time.monotonic() < end + 5:
                time.sleep(0.01)
            return False
        time.sleep(0.01)
    return True


def in_namespace(pid: int, ns: int) -> bool:
    """Whether process `pid` is alive in pid namespace `ns` (a zombie has left it; a reused pid is elsewhere)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == f"pid:[{ns}]"
    except OSError:
        return False
