"""Held-out evaluation inside a run, outside the timed step.

One rank (rank 0, or the asynchronous server) evaluates the model it holds on the held-out split that goes with
the run's data (dtlab.rank.data.load_heldout): dropout off, no gradients, batches of `EVAL_BATCH`, the same
seq_len as training. Evaluation draws no random numbers, so a run with `eval_every` trains exactly as one
without it (same losses bit for bit on CPU).

The clock. `TrainClock` keeps the training time of the evaluating rank: wall time since the first step began,
minus the time spent in evaluations (and in anything else the loop excludes, `exclude`). Each `eval` event
records it as `t` (what time to accuracy is read from), the evaluation's own duration `t_eval`, and `t_wall`
(everything included). In synchronous strategies every rank then waits at a barrier before the next step, so
no rank's step clock runs while rank 0 evaluates: T_step keeps its definition.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.config.convergence import eval_steps

EVAL_BATCH = 256


class TrainClock:
    """Training time on this rank: seconds since `start()` minus the excluded intervals."""

    def __init__(self):
        self.t0: float | None = None
        self.excluded = 0.0

    def start(self) -> None:
        """The first step begins now (only the first call counts)."""
        if self.t0 is None:
            self.t0 = time.perf_counter()

    def wall(self) -> float:
        return 0.0 if self.t0 is None else time.perf_counter() - self.t0

    def train(self) -> float:
        """Training time so far (s): wall time minus what was excluded."""
        return max(0.0, self.wall() - self.excluded)

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds


class Evaluator:
    """Evaluates on one rank; on the others `active` is False and `run` does nothing but return."""

    def __init__(self, evaluation, tokenizer, heldout, device, active: bool, *, total_steps: int, seq_len: int):
        """`evaluation`: the run's evaluation group (`every`); `heldout`: (sentences, labels, source) of the held-out
        split (dtlab.rank.build.build_replica loads it; None on a rank that does not evaluate); `total_steps`: the
        run's optimizer steps (the last evaluation follows the last one). `at`: the step counts after which the run
        evaluates (every rank knows them: they meet at a barrier there)."""
        self.every, self.total, self.active = evaluation.every, total_steps, active and evaluation.every > 0
        self.at = eval_steps(evaluation.every, total_steps)
        self.facts: dict = {}
        if not self.active:
            return
        if heldout is None:
            raise ValueError("heldout: the evaluating rank needs the held-out split (build_replica(heldout=True))")
        sents, labels, src = heldout
        enc = tokenizer(sents, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
        self.ids, self.mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        self.labels = torch.tensor(labels, dtype=torch.long, device=device)
        self.facts = {
            "eval_set": {
                "source": src,
                "sentences": len(sents),
                "positive": sum(labels) / len(labels),
                "every": evaluation.every,
                "batch": EVAL_BATCH,
            }
        }

    def due(self, steps_done: int) -> bool:
        """Whether this rank evaluates after `steps_done` optimizer steps."""
        return self.active and steps_done in self.at

    def evaluate(self, model) -> tuple[float, float, float]:
        """(accuracy, mean cross-entropy, seconds) of `model` on the held-out split; its mode is restored."""
        t0 = time.perf_counter()
        was = model.training
        model.eval()
        correct, loss = 0, 0.0
        with torch.no_grad():
            for i in range(0, len(self.labels), EVAL_BATCH):
                sl = slice(i, i + EVAL_BATCH)
                logits = model(input_ids=self.ids[sl], attention_mask=self.mask[sl]).logits.float()
                y = self.labels[sl]
                correct += int((logits.argmax(-1) == y).sum())
                loss += float(F.cross_entropy(logits, y, reduction="sum"))
        model.train(was)
        n = len(self.labels)
        return correct / n, loss / n, time.perf_counter() - t0

    def run(
        self, model, steps_done: int, clock: TrainClock, writer, rank: int, force: bool = False, **extra
    ) -> dict | None:
        """Evaluate after `steps_done` optimizer steps when due (or `force`d, on an active evaluator): write the
        `eval` event (rank, step, t, accuracy, loss, t_eval, t_wall, n) and exclude its time from `clock`.
        Returns the event's fields, or None."""
        if not (self.due(steps_done) or (force and self.active)):
            return None
        t_train, t_wall = clock.train(), clock.wall()
        acc, loss, dt = self.evaluate(model)
        clock.exclude(dt)
        rec = {
            "rank": rank,
            "step": steps_done,
            "t": t_train,
            "accuracy": acc,
            "loss": loss,
            "t_eval": dt,
            "t_wall": t_wall,
            "n": len(self.labels),
            **extra,
            "time": time.time(),
        }
        writer.write("eval", **rec)
        return rec


def eval_pause(evaluator: Evaluator, model, steps_done: int, clock: TrainClock, writer, rank: int) -> None:
    """Between synchronous steps: the evaluating rank evaluates when due, then every rank meets at a barrier, so
    no rank's step clock runs while it evaluates (the next step starts together, as it would without it). The
    whole pause is left out of the evaluating rank's training time."""
    if steps_done not in evaluator.at:
        return
    t0 = time.perf_counter()
    rec = evaluator.run(model, steps_done, clock, writer, rank)  # excludes its own evaluation time
    dist.barrier()
    if rec is not None:
        clock.exclude(max(0.0, time.perf_counter() - t0 - rec["t_eval"]))
