"""Checkpoint and resume, the reading half: one timeline from a restarted run (the checks before launch are
dtlab.config.restarts's).

How a restarted run works (the rank side is dtlab.rank.restarts):

- `checkpoint_every` N: after every N training steps the ranks save model, optimizer, the number of steps done and
  every rank's RNG states with torch.distributed.checkpoint into RUN/checkpoints/step-K (K = steps done, so a resumed
  run starts at step K). Each checkpoint is written to a temporary folder and renamed by rank 0 once complete, so
  a `step-K` folder is complete or absent; the last 2 are kept.
- `max_restarts` R: torchrun's --max-restarts. When a rank dies, torchrun stops the group and starts it again (at
  most R times); every restarted rank loads the newest complete checkpoint and goes on from there (from step 0
  when there is none: with `checkpoint_every` 0 a restart redoes the whole run). A rank that freezes is not
  restarted: the watchdog stops the run (dtlab.launching.watchdog).
- Events: restarted ranks append to the same events/rank{r}.jsonl; every record carries `attempt` (torchrun's
  TORCHELASTIC_RESTART_COUNT: 0 for the first), a restarted rank writes a `restart` event (attempt, resumed_from,
  t_load) and every save a `checkpoint` event (step, t_save, nbytes).

`final_timeline(rows)` turns the records of all attempts into one timeline: everything an earlier attempt recorded
for a step at or after a later attempt's `resumed_from` was redone, so the later record wins and the earlier one
is lost work (`Run.lost`). Records written before `attempt` existed count as attempt 0. A baseline step (and
every record of it) belongs to the training step it is paired with (`paired_step`): it is redone when that step is;
lost work counts the redone training steps only (a baseline step measures, it does not train).
"""

from __future__ import annotations

STEP_KINDS = ("step",)  # what counts as a step of work (lost when redone)
KEYED_KINDS = ("step", "baseline_step", "bucket", "collective", "blocked", "ddp_stats")  # rows keyed by (rank, step)


def attempt_of(ev: dict) -> int:
    """The attempt (0 = first, 1 = first restart, ...) that wrote an event."""
    return int(ev.get("attempt") or 0)


def final_attempt_events(events: list[dict], attempt: int | None = None) -> list[dict]:
    """The events of one attempt (default: the last one in `events`): what the failure report reads."""
    if not events:
        return []
    last = max(attempt_of(e) for e in events) if attempt is None else attempt
    return [e for e in events if attempt_of(e) == last]


def _superseded(ev: dict, resumes: dict, paired: dict) -> bool:
    """True when a later attempt of the same rank resumed at or before this record's step (it was redone); a
    baseline step's records count at the training step they are paired with."""
    a, step = attempt_of(ev), ev.get("step")
    if step is None:
        return False
    step = paired.get((ev.get("rank"), a, step), step)
    return any(b > a and step >= k for b, k in resumes.get(ev.get("rank"), {}).items())


def final_timeline(rows: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], list[dict]]:
    """(rows with every redone record removed, lost work). `rows` maps an event kind to its records (as load_run
    collects them, without `kind`); `restart` records say where each later attempt resumed. Lost work: one dict
    per redone step (rank, step, attempt, kind, t_step s, loss, wall_time s since the epoch)."""
    resumes: dict = {}
    for ev in rows.get("restart", []):
        if ev.get("resumed_from") is not None:
            resumes.setdefault(ev.get("rank"), {})[attempt_of(ev)] = int(ev["resumed_from"])
    if not resumes:
        return rows, []
    paired = {
        (ev.get("rank"), attempt_of(ev), ev.get("step")): int(ev["paired_step"])
        for ev in rows.get("baseline_step", [])
        if ev.get("paired_step") is not None
    }
    out, lost = dict(rows), []
    for kind in KEYED_KINDS:
        keep = []
        for ev in rows.get(kind, []):
            if not _superseded(ev, resumes, paired):
                keep.append(ev)
            elif kind in STEP_KINDS:
                lost.append(
                    {
                        "rank": ev.get("rank"),
                        "step": ev.get("step"),
                        "attempt": attempt_of(ev),
                        "kind": kind,
                        "t_step": ev.get("t_step"),
                        "loss": ev.get("loss"),
                        "wall_time": ev.get("time"),
                    }
                )
        out[kind] = keep
    return out, lost


FRAMES = {  # the Run attributes `recovery` fills, and their leading columns
    "checkpoints": ["rank", "step", "attempt", "t_save", "nbytes"],
    "restarts": ["rank", "attempt", "resumed_from", "t_load", "down_s"],
    "lost": ["rank", "step", "attempt", "t_step", "loss"],
}


def recovery(rows: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """(rows as one timeline, {Run attribute: its rows}) for load_run: `final_timeline`, the restarts, and the
    checkpoints saved (with wall_time, s since the epoch: the end of the save)."""
    timeline, lost = final_timeline(rows)
    ckpts = [{**ev, "wall_time": ev.get("time")} for ev in rows.get("checkpoint", [])]
    return timeline, {"checkpoints": ckpts, "restarts": restart_rows(rows), "lost": lost}


def restart_rows(rows: dict[str, list[dict]]) -> list[dict]:
    """One dict per rank per restart: rank, attempt, resumed_from (step), checkpoint (folder name or None),
    t_load (s), down_s (s from that rank's last record of the previous attempt to the restart, i.e. the time
    to notice the failure, stop the group, start new processes, rebuild the model and load the checkpoint) and
    wall_time (s since the epoch)."""
    last_time: dict = {}
    for evs in rows.values():
        for ev in evs:
            if isinstance(ev.get("time"), (int, float)):
                key = (ev.get("rank"), attempt_of(ev))
                last_time[key] = max(last_time.get(key, 0.0), float(ev["time"]))
    out = []
    for ev in rows.get("restart", []):
        a, r = attempt_of(ev), ev.get("rank")
        before = [t for (rr, aa), t in last_time.items() if rr == r and aa < a]
        down = float(ev["time"]) - max(before) if before and isinstance(ev.get("time"), (int, float)) else None
        out.append(
            {
                "rank": r,
                "attempt": a,
                "resumed_from": ev.get("resumed_from"),
                "checkpoint": ev.get("checkpoint"),
                "t_load": ev.get("t_load"),
                "down_s": down,
                "wall_time": ev.get("time"),
            }
        )
    return out


def restart_lines(run) -> list[str]:
    """Lines for the breakdown table: each restart, the steps redone and the checkpoints saved."""
    lines = []
    if not run.restarts.empty:
        for a, g in run.restarts.groupby("attempt"):
            down = g["down_s"].max()
            lines.append(
                f"  restart: attempt {int(a)} resumed from step {int(g['resumed_from'].min())}"
                + (f" ({g['checkpoint'].iloc[0]})" if g["checkpoint"].notna().any() else " (no checkpoint)")
                + (f", {down:.1f} s down" if down == down else "")
            )
        lost = run.lost
        per_step = lost.groupby(["attempt", "step"])["t_step"].max()  # the slowest rank's time per redone step
        lines.append(f"  lost work: {len(per_step)} step(s) redone, {per_step.sum() * 1e3:.0f} ms of step time")
    if not run.checkpoints.empty:
        per = run.checkpoints.groupby(["attempt", "step"])
        lines.append(
            f"  checkpoints: {per.ngroups} saved, median {per['t_save'].max().median() * 1e3:.0f} ms and "
            f"{per['nbytes'].sum().median() / 2**20:.1f} MiB each"
        )
    return lines
