"""What a graded notebook may use, and how its errors say it ran out: memory (RLIMIT_AS per process), processes
(RLIMIT_NPROC for the sandbox's uid) and scratch disk (the sandbox's tmpfs); sizes as people write them (4G, 512M).
The sandbox that enforces them is dtlab.course.sandbox."""

from __future__ import annotations

import resource
from dataclasses import dataclass

GiB, MiB = 2**30, 2**20
DEFAULT_MEMORY = 4 * GiB
DEFAULT_DISK = 1 * GiB
DEFAULT_PROCS = 512


@dataclass(frozen=True)
class Limits:
    """What a graded notebook may use: `memory` (bytes of address space per process, RLIMIT_AS), `disk` (bytes of
    scratch tmpfs) and `procs` (processes and threads of the sandbox's uid, RLIMIT_NPROC)."""

    memory: int = DEFAULT_MEMORY
    disk: int = DEFAULT_DISK
    procs: int = DEFAULT_PROCS

    @classmethod
    def given(cls, memory: int | None = None, disk: int | None = None, procs: int | None = None) -> Limits:
        """The limits asked for, each None at its default."""
        return cls(memory or DEFAULT_MEMORY, disk or DEFAULT_DISK, procs or DEFAULT_PROCS)


def size_text(n: int) -> str:
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / MiB:g} MiB"


def parse_size(text) -> int:
    """'4G', '512M', '4GiB', or bytes."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": MiB, "G": GiB, "T": 2**40}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 4G, 512M)") from None


def limits_preexec(memory: int, procs: int):
    """A preexec_fn setting the process limits the sandbox inherits (RLIMIT_AS, RLIMIT_NPROC)."""

    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))

    return apply


def limit_hit(text: str, limits: Limits) -> str | None:
    """The limit a grader's error or a student's exceptions name, if any."""
    memory, disk = limits.memory, limits.disk
    if "No space left on device" in text or "Errno 28" in text:
        return f"scratch disk limit {size_text(disk)} exceeded"
    if "MemoryError" in text or "Cannot allocate memory" in text or "std::bad_alloc" in text:
        return f"memory limit {size_text(memory)} exceeded"
    # A process limit shows as EAGAIN from fork/clone (os.fork, subprocess's fork_exec) or as a thread that could
    # not start; a bare "Resource temporarily unavailable" is also what a non-blocking socket or pipe raises.
    if "can't start new thread" in text or (
        "Resource temporarily unavailable" in text
        and any(w in text for w in ("fork", "_execute_child", "start_new_thread", "pthread_create", "clone"))
    ):
        return "process limit exceeded"
    return None
