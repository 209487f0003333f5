"""Reading a rank's event file (events/rank{r}.jsonl). Pure: the one parser every reader shares."""

from __future__ import annotations

import json


def read_events(path: str) -> list[dict]:
    """Parse one rank's JSONL events; a torn last line (crash mid-write) is skipped, not fatal."""
    out = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
    return out
