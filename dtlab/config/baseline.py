"""Where a run's no-op-hook baseline steps go: interleaved with the training steps, each right after the training
step it is paired with, so that T_comp and T_step are measured close together in time (pure).

Benchmark harnesses alternate A and B against drift for the same reason: a machine whose load changes between
two phases of a run (a neighbour's job arriving, a CPU frequency change) would otherwise put all the baseline
steps on one machine and all the training steps on another. The `baseline_steps` baseline steps are spread over
the measured steps (those >= `warmup`); the last one follows the last training step; with more baseline steps
than measured steps, some training steps are followed by more than one. Baseline step i is numbered
`steps + i` in the run directory (after the training steps, as before they were interleaved) and records the
training step it follows as `paired_step`.
"""

from __future__ import annotations


def auto_baseline_steps(steps, warmup) -> int:
    """`baseline_steps` None: one baseline step after each measured step, at least 3 and at most 8 (the README's
    main job, 8 steps with warmup 2: 6 pairs). More pairs narrow the interval of exposed communication: with 3, a
    90% bootstrap interval of their median spans all three; a long run pays for at most 8."""
    if isinstance(steps, int) and isinstance(warmup, int) and not isinstance(steps, bool):
        return min(max(steps - warmup, 3), 8)
    return 3  # steps or warmup not valid yet: validate() names the field


def baseline_pairs(steps: int, warmup: int, baseline_steps: int) -> list[int]:
    """The training step each baseline step follows (and is paired with), baseline step 0 first.

    Spread evenly over the measured steps warmup .. steps - 1, the last one after the last step:
    steps 8, warmup 2, 3 baseline steps -> [3, 5, 7]; 6 baseline steps -> [2, 3, 4, 5, 6, 7]."""
    if baseline_steps <= 0:
        return []
    first = min(max(warmup, 0), steps - 1)
    measured = steps - first
    return [first + ((i + 1) * measured - 1) // baseline_steps for i in range(baseline_steps)]


def run_order(steps: int, warmup: int, baseline_steps: int, first: int = 0) -> list[tuple[int, int | None]]:
    """The steps a rank runs, in order: (step number, None) for a training step, (steps + i, paired training step)
    for baseline step i, right after its training step. A rank resumed at training step `first` (from a
    checkpoint) starts with that training step: a baseline step needs its paired step measured in the same
    process, so the baseline steps of earlier steps are not redone (those the earlier attempt recorded stay)."""
    pairs = baseline_pairs(steps, warmup, baseline_steps)
    after: dict[int, list[int]] = {}
    for i, s in enumerate(pairs):
        after.setdefault(s, []).append(steps + i)
    order: list[tuple[int, int | None]] = []
    for s in range(first, steps):
        order.append((s, None))
        order += [(b, s) for b in after.get(s, [])]
    return order
