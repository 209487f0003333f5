"""The asynchronous server's bookkeeping, pure (no torch): versions, staleness, and when a worker may go on.

The server's version is the number of updates it has applied. A worker pulls the parameters of some version v,
computes a gradient, and pushes it; when the server takes it, its **staleness** is the server's version minus v:
how many other updates were applied while it was computed. Every push is taken exactly once: applied (the version
goes up by one) or, under policy 'drop', dropped when its staleness exceeds `max_staleness`.

Policy 'wait' (stale-synchronous) never drops: the server holds back a worker's pull (its reply, so the worker
cannot start its next gradient) until starting it can no longer make any gradient staler than `max_staleness` s.
A worker that is computing ("outstanding") on version v will push exactly once; each other outstanding worker
can apply at most one update before it. So the server lets worker Y start only if, for every outstanding worker X
(with a_X updates applied since X pulled), the outstanding workers other than X, Y included, number at most
s - a_X, and the outstanding workers number at most s for Y itself. Updates then never exceed the bound, and the
server can always start someone (with none outstanding the condition holds), so nothing deadlocks. With s = 0 the
workers take turns; with s >= workers - 1 and workers of equal speed, nobody waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Taken:
    """What the server did with one push."""

    worker: int
    step: int
    computed_on: int
    staleness: int
    applied: bool
    version: int
    """The server's version after taking it (one more than before when applied)."""


@dataclass
class Book:
    """The server's state: version, outstanding workers (worker -> version it pulled), held pulls (policy 'wait')."""

    max_staleness: int
    policy: str = "drop"
    version: int = 0
    outstanding: dict = field(default_factory=dict)
    held: list = field(default_factory=list)
    taken: list = field(default_factory=list)

    def __post_init__(self):
        if self.policy not in ("drop", "wait"):
            raise ValueError(f"staleness_policy must be 'drop' or 'wait', got {self.policy!r}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {self.max_staleness!r}")

    def started(self, worker: int) -> None:
        """`worker` received the current parameters and computes on them."""
        self.outstanding[worker] = self.version

    def push(self, worker: int, step: int, computed_on: int) -> Taken:
        """Take a pushed gradient: applied or dropped (the caller applies it when `applied`)."""
        self.outstanding.pop(worker, None)
        staleness = self.version - computed_on
        applied = staleness <= self.max_staleness
        if applied:
            self.version += 1
        t = Taken(worker, step, computed_on, staleness, applied, self.version)
        self.taken.append(t)
        return t

    def may_start(self, worker: int) -> bool:
        """Whether `worker` may start its next gradient now (always under 'drop')."""
        if self.policy == "drop":
            return True
        s, others = self.max_staleness, [w for w in self.outstanding if w != worker]
        if len(others) > s:
            return False
        return all(len(others) <= s - (self.version - self.outstanding[x]) for x in others)

    def release(self, active) -> list:
        """Held workers (in the order they were held) that may start now and are still `active`; each is taken
        off the held list and marked started, one after the other (each start changes the condition)."""
        out = []
        for w in list(self.held):
            if w not in active:
                self.held.remove(w)
            elif self.may_start(w):
                self.held.remove(w)
                self.started(w)
                out.append(w)
        return out

    def histogram(self) -> dict:
        """Applied updates per staleness, {staleness: count}."""
        out: dict = {}
        for t in self.taken:
            if t.applied:
                out[t.staleness] = out.get(t.staleness, 0) + 1
        return dict(sorted(out.items()))
