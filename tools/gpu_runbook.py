#!/usr/bin/env python3
"""Prove dtlab's GPU path on a bare GPU machine in two short commands that fit one lent GPU session.

    python3 tools/gpu_runbook.py proof --wheels .whl --nccl .nccl --out $OUT   # carries .whl and .nccl (the .xz)
    python3 tools/gpu_runbook.py labs --nccl /tmp/dtlab-site/.dtlab-nccl --out $OUT   # carries nothing: the warm
                                                     # machine's /tmp holds the wheels and the library from proof
    python3 tools/gpu_runbook.py plan --nccl .nccl                   # both commands' plans, nothing run
    python3 tools/gpu_runbook.py all --dry-run --wheels .whl --nccl .nccl --out /tmp/dry  # anywhere: both, small
    python3 tools/gpu_runbook.py check-wheels --wheels .whl          # only the wheel folder

A lent session has SESSION_S = 900 s of device time, the machine's start included: START_S (90 s) for the start,
then each command's budget (BUDGETS: proof 390 s, labs 380 s) plus CALL_MARGIN_S (20 s: Python's start, the last
archive, the transfers, the turn between the calls): 90 + 410 + 400 = 900. Where the start took longer, give labs
a --budget that much smaller. The most valuable command comes first:

1. proof (`suite` is its old name): with --nccl, nccl-proof (tools/nccl_proof.py: each of two ranks sharing cuda:0
   reports its ncclGetVersion and NCCL's own "NCCL version" line) before any other step; then the wheel folder and
   what this command carried, the install, the README's main job (DDP on two NCCL ranks sharing the GPU, CUDA-event
   timing, every gradient byte once, `run.crosscheck()` against NCCL's own durations), ZeRO-3, the NCCL
   calibration (three ops, 4 KiB to 256 MiB, with intervals), the strategies (the GPU suite's
   tests/gpu/test_gpu_strategies.py: FSDP2, tensor parallelism, GPipe and 1F1B, PowerSGD, a checkpoint and a
   restart, `reference=True` where the strategy has it; and local SGD from tests/gpu/test_gpu.py), the model's
   error on the main job (its run against the calibration just made), the recorder's overhead against plain DDP,
   the doctor and the rest of the GPU suite.
2. labs: every lab in quick mode top to bottom, on NCCL where --nccl names the library: first the labs whose claims
   are not timings side by side (CLAIM_KINDS; the machine has 16 cores and the GPU memory), then each lab whose
   claims are timings alone, one after another, in number order.

Every step and lab is planned before anything runs: at its slowest clean GPU record (tools/gpu-lab-seconds.json and
the H200 record shipped with dtlab) or, with none, at its cap, saying so. What does not fit the budget is written
down in summary.json's plan (`left_over`, with planned seconds) and, where it is still not reached, in the step's
record; a step or lab that was left over still runs when the ones before it end sooner and its plan fits what is
left.

`--nccl DIR` (optional; `python3 tools/nccl_prepare.py --xz-only` makes the git-ignored `.nccl/`): DIR's
libnccl.so.2 (decompressed there from a carried libnccl.so.2.xz if need be) is checked against libnccl.so.2.sha256
and named in every step's DTLAB_NCCL_LIBRARY, so dtlab preloads it into NCCL ranks. proof keeps a checked copy in
SITE/.dtlab-nccl, the folder labs names on the same warm machine.

Made for machines reached through short remote commands (at most 600 s each; at most 8 files of 16 MiB, 2 folders
deep, come back from the output folder; the working tree and what a command carries travel, 64 MiB in all):

- a part stops starting steps when its budget runs short: a step's timeout is its cap (STEP_CAP) or what is left,
  and a step that cannot get MIN_STEP_S is skipped, saying so;
- `--out` stays small and flat: `summary.json` (the plan, then each step as it ends: a command cut off keeps every
  finished step's figures), `logs.tar.gz` (every step's log and the small files of every run, the recorded runs to
  ship; at most ARCHIVE_MAX_BYTES, what is left out is named), for proof `strategies-junit.xml` and
  `gpu-junit.xml`, for labs `labs.json` (per lab: seconds, the error outputs, every claim with its verdict, where
  its runs were placed, which labs ran beside it);
- the runs go to `--work` and the packages to `--site` (default /tmp/dtlab-site), both outside `--out`. Each part
  installs the wheel folder there unless it is already (`pip --no-index --no-deps --target`, never touching the
  machine's torch); labs without a wheel folder uses what proof installed on the same machine.

The GPU machine is assumed to have python3 with torch (CUDA), transformers and the packages listed in
tools/gpu-device-packages.txt, and no package index; tools/make_gpu_wheels.sh builds the folder elsewhere and
tools/gpu_wheels.py checks it. `--dry-run` walks every step on any machine: the wheel check is real, nothing is
installed, the runs use the tiny model, the GPU tests skip and the labs are planned, not executed. Exit code 0
when every step passed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (ROOT, HERE) if p not in sys.path]  # before any step: no failure can lose it
from gpu_wheels import TREE_MAX_BYTES, check_installed, check_wheels, tree_bytes  # noqa: E402 - after the path is set
from nccl_prepare import LIB as NCCL_LIB  # noqa: E402
from nccl_prepare import SHA as NCCL_SHA  # noqa: E402
from nccl_prepare import ready as nccl_ready  # noqa: E402

from dtlab.config.ncclib import ENV as NCCL_LIBRARY_ENV  # noqa: E402

COMMAND_LIMIT_S = 600  # what one remote command may run
SESSION_S = 900  # a lent GPU session's device time in all, the machine's start included
START_S = 90  # the machine's start ("a minute or more"; where it took longer, give labs that much less --budget)
CALL_MARGIN_S = 20  # per command beyond its budget: Python's start, the last archive, the transfers, the turn
#: Each command's budget (the default --budget): START_S + the sum of (budget + CALL_MARGIN_S) is SESSION_S.
BUDGETS = {"proof": 390, "labs": 380}
MIN_STEP_S = 20  # a step that cannot get this long is skipped, not started
RESERVE_S = 10  # kept back from each step's timeout for writing the summary and the archive
MAX_FILES, MAX_DEPTH = 8, 2
OUT_FILE_MAX_BYTES = 16 * 2**20  # the most one file in --out may hold and still come back
ARCHIVE_MAX_BYTES = 15 * 2**20  # logs.tar.gz stops taking files here (a margin under OUT_FILE_MAX_BYTES)
#: Each command's steps in order, the most valuable first. proof: with --nccl, "nccl-proof" (which library two ranks
#: on one GPU load) before anything else; then what the command carried and the install; the runs on NCCL's shared
#: GPU (DDP, ZeRO-3, the calibration, every strategy), the model's error and the recorder's overhead; the doctor and
#: the rest of the GPU suite last.
PARTS = {
    "proof": (
        "nccl-proof",
        "wheels",
        "install",
        "deps",
        "main-job",
        "zero3",
        "calibrate",
        "strategies",
        "model-error",
        "overhead",
        "doctor",
        "gpu-suite",
    ),
    "labs": ("install", "labs"),
}
ALIASES = {"suite": "proof"}  # the first command's old name
#: Steps that run only when asked for by an option (the option's name): without --nccl there is nothing to prove.
OPTIONAL = {"nccl-proof": "nccl"}
#: Each step's longest run; a step with no GPU record is planned at it.
STEP_CAP = {
    "nccl-proof": 40,
    "wheels": 30,
    "install": 120,
    "deps": 60,
    "main-job": 90,
    "zero3": 90,
    "calibrate": 60,
    "strategies": 100,
    "model-error": 20,
    "overhead": 90,
    "doctor": 30,
    "gpu-suite": 150,
    "labs": BUDGETS["labs"] - RESERVE_S,
}
LAB_CAP_S = 120  # one lab in quick mode (an H100 took 16-75 s for each of labs 00-08; tools/gpu-lab-seconds.json)
#: What each claim a lab prints is about (dtlab/course/claims/labNN.py). A lab with a claim about time runs alone:
#: another lab beside it would share the GPU and the cores its timings judge. The others run side by side.
CLAIM_KINDS = {
    "lab00.sizes": "time",
    "lab01.exposed": "time",
    "lab03.contention": "time",
    "lab03.whatif": "time",
    "lab05.accumulate": "time",
    "lab05.fp16_bytes": "bytes",
    "lab05.fp16_time": "time",
    "lab06.ps_vs_ring": "time",
    "lab06.straggler_wait": "time",
    "lab07.backward": "time",
    "lab07.levels": "time",
    "lab08.ring_vs_all_reduce": "time",
    "lab09.composition": "time",
    "lab09.local_bytes": "bytes",
    "lab09.powersgd_later": "steps",
    "lab09.staleness": "updates",
    "lab10.bubble_falls": "time",
    "lab10.bubble_theory": "time",
    "lab10.tp_allreduces": "count",
    "lab12.interruptions": "time",
}
TIMED_LABS = frozenset(cid[3:5] for cid, kind in CLAIM_KINDS.items() if kind == "time")
KEPT_NCCL = ".dtlab-nccl"  # proof's checked copy of the library, in --site: what labs names on the same machine
ARCHIVED = (".log", ".json", ".jsonl", ".xml", ".txt", ".ipynb")
ARCHIVE_FILE_MAX = 8 * 2**20


def step_timeout(cap: float, remaining: float) -> float | None:
    """Seconds a step may run: its cap or what is left of the budget less RESERVE_S; None when under MIN_STEP_S."""
    t = min(cap, remaining - RESERVE_S)
    return t if t >= MIN_STEP_S else None


def session_plan(budgets: dict | None = None) -> dict:
    """The lent session: the machine's start, then each command's budget and margin, against SESSION_S."""
    budgets = {**BUDGETS, **(budgets or {})}
    commands = [
        {"part": p, "budget_s": budgets[p], "margin_s": CALL_MARGIN_S, "timeout_s": budgets[p] + CALL_MARGIN_S}
        for p in PARTS
    ]
    total = START_S + sum(c["timeout_s"] for c in commands)
    return {
        "start_s": START_S,
        "commands": commands,
        "total_s": total,
        "session_s": SESSION_S,
        "fits": total <= SESSION_S and all(c["timeout_s"] <= COMMAND_LIMIT_S for c in commands),
        "how": f"{START_S} s start + "
        + " + ".join(f"{c['part']} {c['budget_s']:g} s + {c['margin_s']} s" for c in commands)
        + f" = {total:g} s of {SESSION_S} s",
    }


def lab_schedule(planned: dict, budget: float) -> dict:
    """The labs' order and what fits `budget` seconds: first one batch of the labs whose claims are not timings, side
    by side (planned at its slowest lab), then each timed lab alone in number order. A batch that does not fit what
    is left is left over, written down with its planned seconds; a later, shorter one may still fit."""
    together = sorted(n for n in planned if n[:2] not in TIMED_LABS)
    alone = sorted(n for n in planned if n[:2] in TIMED_LABS)
    batches = ([together] if together else []) + [[n] for n in alone]
    fits, left, used = [], [], 0.0
    for labs in batches:
        s = round(max(planned[n] for n in labs), 1)
        batch = {"labs": labs, "side_by_side": len(labs) > 1, "planned_s": s}
        if used + s <= budget:
            fits.append({**batch, "starts_at_s": round(used, 1)})
            used += s
        else:
            left.append(batch)
    return {
        "budget_s": round(budget, 1),
        "batches": fits,
        "planned_s": round(used, 1),
        "left_over": left,
        "left_over_labs": {n: planned[n] for b in left for n in b["labs"]},
        "left_over_s": round(sum(planned[n] for b in left for n in b["labs"]), 1),
    }


def plan_steps(steps: list, budget: float, records: dict, labs: dict | None = None) -> dict:
    """Each step with its planned seconds and where they come from: its slowest GPU record (`records`: {step:
    {"seconds", "record"}}), else its cap; the labs step at its schedule (`labs`: {notebook: planned seconds}) in what
    the steps before it leave. A step that does not fit the budget (less RESERVE_S) is left over."""
    rows, left, used = [], [], 0.0
    for step in steps:
        if step == "labs" and labs is not None:
            sched = lab_schedule(labs, budget - RESERVE_S - used)
            row = {"step": step, "planned_s": sched["planned_s"], "from": "the labs' schedule", "labs": sched}
        elif step in records:
            rec = records[step]
            row = {"step": step, "planned_s": rec["seconds"], "from": f"the slowest GPU record ({rec['record']})"}
        else:
            row = {"step": step, "planned_s": STEP_CAP[step], "from": "no GPU record: its cap"}
        if used + row["planned_s"] + RESERVE_S <= budget:
            rows.append(row)
            used += row["planned_s"]
        else:
            left.append(row)
    labs_row = next((r for r in rows + left if "labs" in r), None)
    return {
        "budget_s": budget,
        "steps": rows,
        "planned_s": round(used, 1),
        "left_over": left,
        "left_over_s": round(sum(r["planned_s"] for r in left), 1),
        "left_over_labs": labs_row["labs"]["left_over_labs"] if labs_row else {},
    }


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def out_listing(out: str) -> dict:
    """{files: [(relative path, bytes)], depth}: what would come back from `out`."""
    files, depth = [], 0
    for d, _, names in os.walk(out):
        rel = os.path.relpath(d, out)
        level = 0 if rel == "." else rel.count(os.sep) + 1
        for n in names:
            files.append((os.path.normpath(os.path.join(rel, n)), os.path.getsize(os.path.join(d, n))))
            depth = max(depth, level)
    return {"files": sorted(files), "depth": depth}


def _folder_bytes(folder: str, but: tuple = ()) -> int:
    """Bytes of the files directly in `folder` (the NCCL folder: a library, its .xz, its sha256), less those named."""
    if not os.path.isdir(folder):
        return 0
    return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file() and e.name not in but)


def fresh_work(part: str) -> str:
    """A new work folder for one invocation of `part`: TMP/dtlab-gpu-work/PART-YYYYmmdd-HHMMSS-PID (-2, -3, ... if
    taken). A run never overwrites a directory, so a fixed folder made a second invocation on the same machine fail
    at its first run ("already holds a run")."""
    root = os.path.join(tempfile.gettempdir(), "dtlab-gpu-work")
    os.makedirs(root, exist_ok=True)
    base, k = os.path.join(root, f"{part}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"), 1
    while True:
        path = base if k == 1 else f"{base}-{k}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            k += 1


@contextlib.contextmanager
def _environ(env: dict):
    """os.environ with DTLAB_NCCL_LIBRARY as `env` has it, for code run in this process (the labs' placements)."""
    old = os.environ.get(NCCL_LIBRARY_ENV)
    if env.get(NCCL_LIBRARY_ENV):
        os.environ[NCCL_LIBRARY_ENV] = env[NCCL_LIBRARY_ENV]
    else:
        os.environ.pop(NCCL_LIBRARY_ENV, None)
    try:
        yield
    finally:
        os.environ.pop(NCCL_LIBRARY_ENV, None) if old is None else os.environ.update({NCCL_LIBRARY_ENV: old})


def _kill(proc: subprocess.Popen) -> None:
    """Stop a child started in its own session, and everything it started (a kernel, torchrun, its ranks)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Runbook:
    """One part: its plan, then its steps in order, each recorded in summary.json as soon as it ends."""

    def __init__(self, part: str, args):
        part = ALIASES.get(part, part)
        self.part, self.args, self.dry = part, args, args.dry_run
        self.out = os.path.abspath(args.out)
        self.site = os.path.abspath(args.site)
        work = os.path.abspath(args.work or os.path.join(tempfile.gettempdir(), "dtlab-gpu-work"))
        for flag, path in (("--site", self.site), ("--work", work)):
            if _inside(path, self.out):
                raise SystemExit(
                    f"{flag} {path} is inside --out {self.out}: only the summary and the log archive "
                    "may go there (at most 8 files come back)"
                )
        os.makedirs(self.out, exist_ok=True)
        self.work = os.path.abspath(args.work or fresh_work(part))  # after the checks: a refusal makes no folder
        os.makedirs(self.work, exist_ok=True)
        budget = getattr(args, "budget", None)
        self.t0, self.budget = time.monotonic(), float(BUDGETS[part] if budget is None else budget)
        self.summary = {
            "part": part,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "dry_run": self.dry,
            "limits": {
                "command_s": COMMAND_LIMIT_S,
                "budget_s": self.budget,
                "max_files": MAX_FILES,
                "max_depth": MAX_DEPTH,
                "out_file_max_bytes": OUT_FILE_MAX_BYTES,
            },
            "site": self.site,
            "work": self.work,
            "steps": {},
            "writes": 0,
        }
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
        self.env["PYTHONPATH"] = os.pathsep.join(
            [ROOT]
            + ([] if self.dry else [self.site])
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        self.nccl = self._nccl(getattr(args, "nccl", None))
        self._lab_plan = None
        if not self.dry and self._installed():
            self._use_site()

    def _nccl(self, folder: str | None) -> dict | None:
        """With --nccl: the folder's libnccl.so.2 (decompressed from a carried .xz if need be) checked against its
        sha256; when it passes, every step's environment names it in DTLAB_NCCL_LIBRARY (dtlab preloads it into NCCL
        ranks), and proof keeps a copy in SITE/.dtlab-nccl for labs on the same machine. Recorded either way."""
        if not folder:
            return None
        res = nccl_ready(folder)
        if res["ok"]:
            self.env[NCCL_LIBRARY_ENV] = res["path"]
            if self.part == "proof":
                res["kept"] = self._keep_nccl(res)
        self.summary["nccl"] = {**res, "env": {NCCL_LIBRARY_ENV: res["path"]} if res["ok"] else {}}
        return res

    def _keep_nccl(self, res: dict) -> str:
        """A copy of the checked library and its sha256 in SITE/.dtlab-nccl (a warm machine keeps /tmp between
        commands): labs names it with --nccl and carries nothing."""
        keep = os.path.join(self.site, KEPT_NCCL)
        if os.path.realpath(keep) != os.path.realpath(res["folder"]):
            os.makedirs(keep, exist_ok=True)
            for name in (NCCL_LIB, NCCL_SHA):
                shutil.copyfile(os.path.join(res["folder"], name), os.path.join(keep, name))
        return keep

    # ---- the plan ----------------------------------------------------------------------------------------
    def steps(self, only=None) -> list:
        return [
            s
            for s in PARTS[self.part]
            if (only is None or s in only) and (s not in OPTIONAL or getattr(self.args, OPTIONAL[s], None))
        ]

    def plan(self, steps: list) -> dict:
        """This command's steps with their planned seconds and where each comes from, what is left over, and the
        whole session's arithmetic (the machine's start and both commands against SESSION_S)."""
        from runbook_figures import recorded_step_seconds

        labs = {n: p["planned_s"] for n, p in self._labs_plan().items()} if "labs" in steps else None
        return {
            "session": session_plan({self.part: self.budget}),
            **plan_steps(steps, self.budget, recorded_step_seconds(), labs),
        }

    def _labs_plan(self) -> dict:
        """{notebook: its placements, cap, planned seconds, where they come from, alone or side by side}: each lab at
        its slowest clean time on a GPU (runbook_figures.recorded_lab_seconds) or at the per-lab cap where no record
        times it, saying so."""
        if self._lab_plan is not None:
            return self._lab_plan
        from runbook_figures import lab_plan, recorded_lab_seconds

        names = sorted(n for n in os.listdir(os.path.join(ROOT, "labs")) if n.endswith(".ipynb"))
        seconds = recorded_lab_seconds()
        plan = {}
        with _environ(self.env):  # placed as the labs' ranks will be, with this command's NCCL library
            for n in names:
                known = seconds.get(n)
                plan[n] = {
                    "placed": lab_plan(n),
                    "cap_s": LAB_CAP_S,
                    "planned_s": known["seconds"] if known else LAB_CAP_S,
                    "from": f"the slowest clean record ({known['record']})"
                    if known
                    else "no clean GPU record: the cap",
                    "runs": "alone: its claims are timings" if n[:2] in TIMED_LABS else "side by side",
                }
        self._lab_plan = plan
        return plan

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def record(self, name: str, ok: bool, **facts) -> bool:
        """Record a step and rewrite summary.json and logs.tar.gz at once."""
        self.summary["steps"].setdefault(name, {}).update(
            ok=bool(ok), done_at_s=round(time.monotonic() - self.t0, 1), **facts
        )
        print(f"[{name}] {'ok' if ok else 'FAILED'}", flush=True)
        self.write()
        return ok

    def write(self) -> None:
        self.summary["writes"] += 1
        self.summary["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self._archive()
        tmp = os.path.join(self.out, ".summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.summary, f, indent=2, default=str)
        os.replace(tmp, os.path.join(self.out, "summary.json"))

    def _archive(self) -> None:
        """Every step log and the runs' small files (no checkpoints), as one archive in --out: logs first, then the
        runs, until the archive reaches ARCHIVE_MAX_BYTES (the files left out are counted in the summary)."""
        paths = []
        for d, dirs, names in os.walk(self.work):
            dirs[:] = sorted(x for x in dirs if x not in ("checkpoints", "__pycache__"))
            paths += [os.path.join(d, n) for n in sorted(names) if n.endswith(ARCHIVED)]
        paths.sort(key=lambda p: (os.path.dirname(p) != self.work, p))  # the step logs first
        buf, left = io.BytesIO(), []
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for p in paths:
                if os.path.getsize(p) > ARCHIVE_FILE_MAX or buf.tell() + os.path.getsize(p) > ARCHIVE_MAX_BYTES:
                    left.append(os.path.relpath(p, self.work))
                    continue
                tar.add(p, arcname=os.path.relpath(p, self.work))
        if left:
            self.summary["archive_left_out"] = {"files": len(left), "first": left[:20]}
        tmp = os.path.join(self.out, ".logs.tar.gz.tmp")
        with open(tmp, "wb") as f:
            f.write(buf.getvalue())
        os.replace(tmp, os.path.join(self.out, "logs.tar.gz"))

    def sh(self, name: str, cmd: list[str], timeout: float, cwd: str = ROOT, env: dict | None = None) -> int | None:
        """Run `cmd` with its output in WORK/NAME.log; the return code, or None when it ran out of time."""
        log = os.path.join(self.work, f"{name}.log")
        print(f"[{name}] $ {' '.join(cmd)} (timeout {timeout:.0f} s)", flush=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=env or self.env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                process_group=0,
            )  # fmt: skip
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill(proc)
                rc = None
        with open(log) as f:
            tail = f.read()[-1500:]
        self.summary["steps"].setdefault(name, {}).update(
            cmd=" ".join(cmd), rc=rc, timeout_s=round(timeout), seconds=round(time.monotonic() - t0, 1)
        )
        if rc != 0:
            self.summary["steps"][name]["log_tail"] = tail
            print(tail, flush=True)
        return rc

    def _stamp(self) -> list | None:
        try:
            with open(os.path.join(self.site, ".dtlab-wheels.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _installed(self) -> bool:
        """The site holds the wheel folder's wheels, or (no wheel folder carried) what an earlier command installed."""
        stamp = self._stamp()
        return bool(stamp) and (stamp == self._wheel_names() or not os.path.isdir(self.args.wheels))

    def _wheel_names(self) -> list:
        w = self.args.wheels
        return sorted(f for f in os.listdir(w) if f.endswith(".whl")) if os.path.isdir(w) else []

    def _use_site(self) -> None:
        import importlib

        if self.site not in sys.path:
            sys.path.insert(1, self.site)
        sys.path_importer_cache.pop(self.site, None)
        importlib.invalidate_caches()

    def carried(self, wheel_bytes: int) -> dict:
        """What this command carries besides the tree: the wheel folder and the NCCL folder as it came (its .xz
        where the library was decompressed here), each only where it is in the checkout; against 64 MiB."""
        nccl = 0
        if self.nccl and _inside(self.nccl["folder"], ROOT):
            nccl = _folder_bytes(self.nccl["folder"], (NCCL_LIB,) if self.nccl.get("decompressed") else ())
        wheels = wheel_bytes if os.path.isdir(self.args.wheels) else 0
        tree = tree_bytes(ROOT)
        total = tree + wheels + nccl
        mib = lambda b: round(b / 2**20, 1)  # noqa: E731
        res = {"tree_mib": mib(tree), "wheels_mib": mib(wheels), "nccl_mib": mib(nccl), "travels_mib": mib(total)}
        res.update(tree_bytes=tree, wheels_bytes=wheels, nccl_bytes=nccl)
        res["ok"] = total <= TREE_MAX_BYTES
        if not res["ok"]:
            res["problem"] = (
                f"the tree, the wheels and the NCCL folder come to {mib(total)} MiB, over the "
                f"{TREE_MAX_BYTES / 2**20:.0f} MiB that travel: carry the library's .xz instead "
                "(tools/nccl_prepare.py --xz-only; the runbook decompresses it)"
            )
        return res

    # ---- the steps ----------------------------------------------------------------------------------------
    def wheels(self, timeout) -> bool:
        """The wheel folder checked, and what this command carried (tree, wheels, NCCL folder) against 64 MiB."""
        res = check_wheels(self.args.wheels)
        carried = self.carried(res.get("bytes", 0))
        if not carried["ok"]:
            res["ok"] = False
            res["problems"].append(carried["problem"])
        for p in res["problems"]:
            print(f"[wheels] {p}")
        return self.record("wheels", res.pop("ok"), carried=carried, **res)

    def install(self, timeout) -> bool:
        """The wheel folder into --site, unless there already; without a folder (labs on proof's warm machine),
        what an earlier command installed there. Records what this command carried."""
        names = self._wheel_names()
        carried = self.carried(sum(os.path.getsize(os.path.join(self.args.wheels, n)) for n in names))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
        cmd += ["--target", self.site] + [os.path.join(self.args.wheels, n) for n in names]
        if self.dry:
            return self.record(
                "install",
                carried["ok"],
                cmd=" ".join(cmd[:12]) + " ...",
                note="dry run: not installed",
                carried=carried,
            )
        if self._installed():
            how = f"{len(names)} wheels" if names else f"no wheel folder carried: {len(self._stamp())} wheels"
            return self.record(
                "install", carried["ok"], note=f"already installed in {self.site} ({how})", carried=carried
            )
        if not names:
            return self.record(
                "install",
                False,
                carried=carried,
                error=f"no wheels in {self.args.wheels} and none installed in {self.site}: this is not the warm "
                "machine of the proof command, so carry the wheel folder (and the NCCL folder) again",
            )
        ok = self.sh("install", cmd, timeout) == 0
        if ok:
            with open(os.path.join(self.site, ".dtlab-wheels.json"), "w") as f:
                json.dump(names, f)
            self._use_site()
        return self.record("install", ok and carried["ok"], wheels=len(names), carried=carried)

    def deps(self, timeout) -> bool:
        if self.dry:
            return self.record("deps", True, note="dry run: nothing installed to check")
        res = check_installed(self.site, timeout_s=timeout)
        return self.record("deps", res.pop("ok"), **res)

    def nccl_proof(self, timeout) -> bool:
        """tools/nccl_proof.py: two ranks on cuda:0 with the --nccl library preloaded as dtlab preloads it; each one's
        ncclGetVersion and loaded file, NCCL's own "NCCL version" lines and a tiny all_reduce (skipped, saying so, on
        a dry run or without CUDA)."""
        if not self.nccl["ok"]:
            return self.record("nccl-proof", False, problems=self.nccl["problems"])
        out = os.path.join(self.work, "nccl-proof.json")
        cmd = [sys.executable, os.path.join(HERE, "nccl_proof.py"), self.nccl["path"], "--json", out]
        cmd += ["--timeout", str(round(max(10.0, timeout - 10)))] + (["--no-cuda"] if self.dry else [])
        rc = self.sh("nccl-proof", cmd, timeout)
        try:
            with open(out) as f:
                proof = json.load(f)
        except (OSError, ValueError):
            proof = {"ok": False}
        self.summary["nccl_proof"] = proof
        return self.record("nccl-proof", rc == 0 and proof.get("ok", False), library=self.nccl["path"])

    def doctor(self, timeout) -> bool:
        rc = self.sh("doctor", [sys.executable, "-m", "dtlab", "doctor", "--json", "--no-hub"], timeout)
        with open(os.path.join(self.work, "doctor.log")) as f:
            text = f.read()
        try:
            facts = json.loads(text[text.index("{") :])
        except ValueError:
            facts = {}
        self.summary["doctor"] = facts
        return self.record(
            "doctor", rc == 0 and bool(facts), gpus=facts.get("gpus"), nccl=facts.get("nccl"), torch=facts.get("torch")
        )

    def _pytest(self, name: str, targets: list, timeout) -> bool:
        """The GPU tests `targets` with their runs under WORK/NAME (so the archive keeps them) and NAME-junit.xml (for
        gpu-suite, gpu-junit.xml) in --out: counts, skip reasons and failures. On a GPU they must run, not skip."""
        xml = os.path.join(self.out, "gpu-junit.xml" if name == "gpu-suite" else f"{name}-junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider", *targets]
        rc = self.sh(name, cmd + [f"--basetemp={os.path.join(self.work, name)}", f"--junitxml={xml}"], timeout)
        counts = {}
        if os.path.exists(xml):
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            counts["skip_reasons"] = sorted({s.get("message", "") for s in suite.iter("skipped")})
            counts["failed"] = sorted(
                c.get("name")
                for c in suite.iter("testcase")
                if c.find("failure") is not None or c.find("error") is not None
            )
        ok = rc == 0 and counts.get("tests", 0) > 0
        if not self.dry:  # on a GPU machine the tests must really run, not skip
            ok = ok and counts.get("skipped", 0) < counts.get("tests", 0)
        return self.record(name, ok, runs=os.path.join(self.work, name), **counts)

    #: The strategies, as the GPU suite runs them (its runs side by side), and local SGD from its levers' test.
    STRATEGY_TESTS = ("tests/gpu/test_gpu_strategies.py", "tests/gpu/test_gpu.py::test_convergence_levers_on_cuda")

    def strategies(self, timeout) -> bool:
        """FSDP2, tp, dp x tp, GPipe, 1F1B (reference=True), fp16, PowerSGD, accumulation, a straggler, a killed rank
        resumed from its checkpoint, local SGD: the GPU suite's own tests."""
        return self._pytest("strategies", list(self.STRATEGY_TESTS), timeout)

    def gpu_suite(self, timeout) -> bool:
        """The rest of the GPU suite (tests/gpu less what the strategies step ran)."""
        rest = ["tests/gpu", "--ignore=tests/gpu/test_gpu_strategies.py"]
        return self._pytest("gpu-suite", rest + [f"--deselect={t}" for t in self.STRATEGY_TESTS[1:]], timeout)

    def _nccl_expected(self) -> bool:
        """Whether this step's runs must be NCCL ranks: a GPU run with a library that checked out."""
        return not self.dry and bool(self.nccl and self.nccl["ok"])

    def main_job(self, timeout) -> bool:
        """The README's main job (DistilBERT, batch 8 x 64, 8 steps; tiny on a dry run): with --nccl, two NCCL ranks
        sharing the GPU, timed by CUDA events, every gradient byte once, dtlab's bucket times against NCCL's own."""
        from runbook_figures import ddp_figures

        run_dir = os.path.join(self.work, "first")
        size = ["--model", "distilbert", "--steps", "8", "--batch-size", "8", "--seq-len", "64"]
        if self.dry:
            size = ["--model", "tiny", "--steps", "4", "--warmup", "1", "--batch-size", "4", "--seq-len", "32"]
            size += ["--bucket-mb", "0.05", "--baseline-steps", "2"]
        cmd = [sys.executable, "-m", "dtlab", "run", *size, "--out", run_dir, "--no-progress"]
        if self.sh("main-job", cmd, timeout) != 0:
            return self.record("main-job", False)
        self.summary["main_job"], ok = ddp_figures(run_dir, nccl=self._nccl_expected())
        return self.record("main-job", ok, run_dir=run_dir)

    def zero3(self, timeout) -> bool:
        from runbook_figures import zero3_figures

        run_dir = os.path.join(self.work, "zero3")
        size = (
            ["--model", "tiny", "--steps", "3", "--warmup", "1", "--batch-size", "4", "--seq-len", "32"]
            if self.dry
            else ["--model", "distilbert", "--steps", "6", "--batch-size", "8", "--seq-len", "64"]
        )
        cmd = [sys.executable, "-m", "dtlab", "run", "--strategy", "zero3", *size, "--out", run_dir, "--no-progress"]
        if self.sh("zero3", cmd, timeout) != 0:
            return self.record("zero3", False)
        self.summary["zero3"], ok = zero3_figures(run_dir)
        return self.record("zero3", ok, run_dir=run_dir)

    def calibrate(self, timeout) -> bool:
        """all_reduce, all_gather and reduce_scatter at 4 KiB to 256 MiB (17 sizes; 4 KiB to 4 MiB on a dry run), two
        ranks (with --nccl: NCCL's shared GPU), each fit with its intervals."""
        from runbook_figures import calibration_figures

        out = os.path.join(self.work, "profile")
        sizes = "4K,64K,1M,4M" if self.dry else ",".join(f"{2**k}" for k in range(12, 29))  # 4 KiB .. 256 MiB
        extra = ["--iters", "2", "--rounds", "1"] if self.dry else ["--iters", "8", "--rounds", "2"]
        cmd = [
            sys.executable,
            "-m",
            "dtlab",
            "calibrate",
            "--nproc",
            "2",
            "--ops",
            "all_reduce,reduce_scatter,all_gather",
        ]
        if self.sh("calibrate", cmd + ["--sizes", sizes, *extra, "--out", out, "--no-progress"], timeout) != 0:
            return self.record("calibrate", False)
        self.summary["calibration"], ok = calibration_figures(out)
        return self.record("calibrate", ok, profile=out)

    def model_error(self, timeout) -> bool:
        """The alpha-beta model's T_step and T_comm errors on the main job, priced with the calibration just made
        (dtlab.predict): no run of its own."""
        from runbook_figures import model_error_figures

        run_dir, profile = os.path.join(self.work, "first"), os.path.join(self.work, "profile")
        missing = [p for p in (run_dir, profile) if not os.path.isdir(p)]
        if missing:
            return self.record("model-error", False, error=f"needs the main job and the calibration: no {missing}")
        self.summary["model_error"], ok = model_error_figures(run_dir, profile)
        return self.record("model-error", ok)

    def labs(self, timeout) -> bool:
        """Every lab top to bottom in quick mode, each in a fresh folder, in the schedule's batches (lab_schedule): the
        side-by-side batch, then each timed lab alone; a batch left over by the plan, or reached with less time left
        than its plan, is written down with its planned seconds. labs.json in --out after every batch. A dry run plans
        them (placements, planned seconds, batches) and executes none."""
        plan = self._labs_plan()
        sched = lab_schedule({n: p["planned_s"] for n, p in plan.items()}, timeout)
        refused = [n for n, p in plan.items() if any(x["label"].startswith("cannot run") for x in p["placed"])]
        facts = dict(planned=plan, refused=refused, planned_s=sched["planned_s"], schedule=sched["batches"])
        facts.update(left_over=sched["left_over_labs"], left_over_s=sched["left_over_s"])
        if self.dry:
            note = "dry run: planned, not executed (tests/e2e/test_notebooks.py executes them on CPU)"
            return self.record("labs", not refused and bool(plan), note=note, **facts)
        record, t_end = {}, time.monotonic() + timeout
        for batch in sched["batches"] + sched["left_over"]:  # the plan's batches, then what it left over
            left = t_end - time.monotonic()
            if batch["planned_s"] > left or left < MIN_STEP_S:
                for n in batch["labs"]:
                    record[n] = {
                        "left_over": f"planned {plan[n]['planned_s']} s ({plan[n]['from']}); {left:.0f} s were left "
                        "of the labs step: not started",
                        "planned_s": plan[n]["planned_s"],
                        "placed": plan[n]["placed"],
                    }
                continue
            record.update(self._lab_batch(batch["labs"], min(LAB_CAP_S, left), plan))
            self._write_json("labs.json", record)
        self._write_json("labs.json", record)
        ran = {n: r for n, r in record.items() if "left_over" not in r}
        failed = sorted(n for n, r in ran.items() if r.get("rc") != 0)
        contradicted = sorted(
            c["cid"] for r in ran.values() for c in r.get("claims", []) if c.get("outcome") == "contradicted"
        )
        facts.update(left_over={n: r["planned_s"] for n, r in record.items() if "left_over" in r})
        facts["left_over_s"] = round(sum(facts["left_over"].values()), 1)
        seconds = {n: r.get("seconds") for n, r in ran.items()}
        return self.record("labs", not failed, failed=failed, contradicted=contradicted, seconds=seconds, **facts)

    def _lab_batch(self, names: list, timeout: float, plan: dict) -> dict:
        """Lab notebooks `names` executed in quick mode at once, each in its own folder and session: {notebook: its
        record (errors, claims, rc, seconds, placements, runs, the labs beside it)}."""
        from runbook_figures import lab_record, lab_runs

        started, ended = {}, {}
        for n in names:
            where = os.path.join(self.work, "labs", n[: -len(".ipynb")])
            os.makedirs(where, exist_ok=True)
            executed = os.path.join(self.work, "labs", n)
            cmd = [sys.executable, os.path.join(HERE, "run_notebook.py"), os.path.join(ROOT, "labs", n), where]
            log = open(os.path.join(self.work, f"lab-{n[:2]}.log"), "w")  # noqa: SIM115 - closed below
            print(f"[lab-{n[:2]}] $ {' '.join(cmd)} (timeout {timeout:.0f} s)", flush=True)
            proc = subprocess.Popen(
                cmd + ["--save", executed], cwd=ROOT, env=dict(self.env, DTLAB_QUICK="1"), stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0,
            )  # fmt: skip
            started[n] = (proc, log, time.monotonic(), where, executed)
        deadline = time.monotonic() + timeout
        while len(ended) < len(started) and time.monotonic() < deadline:
            for n, (proc, *_rest) in started.items():
                if n not in ended and proc.poll() is not None:
                    ended[n] = time.monotonic()
            time.sleep(0.2)
        out = {}
        for n, (proc, log, t0, where, executed) in started.items():
            if n not in ended:
                _kill(proc)
            log.close()
            rc = proc.returncode if n in ended else None
            out[n] = {
                **lab_record(executed),
                "rc": rc,
                "seconds": round(ended.get(n, time.monotonic()) - t0, 1),
                "planned_s": plan[n]["planned_s"],
                "beside": [m for m in names if m != n],
                "placed": plan[n]["placed"],
                "runs": lab_runs(where),
            }
            if rc != 0:
                with open(log.name) as f:
                    out[n]["log_tail"] = f.read()[-1500:]
        return out

    def _write_json(self, name: str, doc) -> None:
        tmp = os.path.join(self.out, f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.out, name))

    def _benchmark(self, name: str, script: str, args: list, timeout) -> tuple[bool, dict]:
        """Run benchmarks/SCRIPT with --json, its runs under WORK/NAME-runs (so the archive keeps them); (ok, its
        figures). A dry run only checks that it starts (--help)."""
        path = os.path.join(ROOT, "benchmarks", script)
        if self.dry:
            return self.sh(name, [sys.executable, path, "--help"], timeout) == 0, {
                "note": "dry run: planned, not run (measured on the GPU)",
                "args": args,
            }
        out, runs = os.path.join(self.work, f"{name}.json"), os.path.join(self.work, f"{name}-runs")
        os.makedirs(runs, exist_ok=True)
        env = dict(self.env, TMPDIR=runs)  # the benchmark makes its run folders with tempfile
        if self.sh(name, [sys.executable, path, *args, "--json", out], timeout, env=env) != 0:
            return False, {}
        with open(out) as f:
            return True, json.load(f)

    OVERHEAD_PAIRS = 2

    def overhead(self, timeout) -> bool:
        """The recorder's overhead on this machine: the README's job with recording on and off (plain DDP),
        interleaved, on the same ranks as the main job."""
        args = ["--pairs", str(self.OVERHEAD_PAIRS), "--model", "distilbert", "--steps", "6"]
        ok, figs = self._benchmark("overhead", "recorder_overhead.py", args, timeout)
        if ok and not self.dry:
            figs = {
                "overhead": figs["overhead"],
                "plain_T_step_ms": [t * 1e3 for t in figs["plain_s"]],
                "recorded_T_step_ms": [t * 1e3 for t in figs["recorded_s"]],
                "pairs": self.OVERHEAD_PAIRS,
            }
        self.summary["overhead"] = figs
        return self.record("overhead", ok)

    # ---- the part -----------------------------------------------------------------------------------------
    def run(self, only=None) -> int:
        steps = self.steps(only)
        self.summary["planned"] = steps
        self.summary["plan"] = self.plan(steps)
        self.write()
        ok = True
        planned = {r["step"]: r for r in self.summary["plan"]["steps"] + self.summary["plan"]["left_over"]}
        for name in steps:
            timeout = step_timeout(STEP_CAP[name], self.remaining())
            row = planned.get(name)
            if name != "labs" and row and timeout is not None and row["planned_s"] > self.remaining() - RESERVE_S:
                # left over by the plan and still not reached with time for it: written down, not started (a
                # start would only run out of time); not a failure of the steps that did run
                left = f"planned {row['planned_s']} s ({row['from']}); {self.remaining():.0f} s left: not started"
                self.record(name, True, left_over=left)
                continue
            if timeout is None:
                skipped = f"{self.remaining():.0f} s left of this command's {self.budget:.0f} s budget: not started"
                ok = self.record(name, False, skipped=skipped) and ok
                continue
            try:
                ok = getattr(self, name.replace("-", "_"))(timeout) and ok
            except Exception as e:  # noqa: BLE001 - one failed step must not hide the others' figures
                ok = self.record(name, False, error=f"{type(e).__name__}: {e}") and ok
        self.summary["ok"] = ok
        self.summary["out_files"] = out_listing(self.out)
        self.write()
        print(f"summary: {os.path.join(self.out, 'summary.json')} ({'all steps passed' if ok else 'some FAILED'})")
        return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=[*PARTS, *ALIASES, "all", "plan", "check-wheels"])
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="wheel folder (default .whl)")
    ap.add_argument("--out", default="gpu-proof", help="summary.json and logs.tar.gz go here (keep it $OUT)")
    ap.add_argument(
        "--site",
        default=os.path.join(tempfile.gettempdir(), "dtlab-site"),
        help="where the wheels are installed and proof keeps the NCCL library (outside --out)",
    )
    ap.add_argument(
        "--work",
        default=None,
        help="run directories and logs (default: a new "
        "TMP/dtlab-gpu-work/PART-TIME-PID each invocation; a folder given here must not hold its runs yet)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds this command plans for (default: proof {proof}, labs {labs})".format(**BUDGETS),
    )
    ap.add_argument(
        "--nccl",
        default=None,
        help="a folder holding libnccl.so.2 (or its .xz) and libnccl.so.2.sha256 (tools/nccl_prepare.py makes .nccl): "
        "checked, named in every step's DTLAB_NCCL_LIBRARY, and proven first by proof's nccl-proof step",
    )
    ap.add_argument("--steps", default=None, help="only these steps of the part, comma-separated")
    ap.add_argument("--dry-run", action="store_true", help="check every step, install nothing, run small")
    return ap


def _print_plan(args) -> int:
    """Both commands' plans (steps, labs, what is left over) and the session's arithmetic, as JSON; nothing runs."""
    args.dry_run = True
    with tempfile.TemporaryDirectory() as tmp:
        args.out, args.work = os.path.join(tmp, "out"), os.path.join(tmp, "work")
        args.site = os.path.join(tmp, "site")  # proof keeps its NCCL copy there: a plan leaves nothing behind
        plans = {}
        for part in PARTS:
            rb = Runbook(part, args)
            plans[part] = rb.plan(rb.steps())
    print(json.dumps(plans, indent=1, default=str))
    return 0 if all(p["session"]["fits"] for p in plans.values()) else 1


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.part == "check-wheels":
        res = check_wheels(args.wheels)
        for p in res["problems"]:
            print(p)
        print(f"{res['wheels']} wheels, {res.get('bytes', 0) / 2**20:.1f} MiB: {'ok' if res['ok'] else 'NOT ok'}")
        return 0 if res["ok"] else 1
    if args.part == "plan":
        return _print_plan(args)
    only = set(args.steps.split(",")) if args.steps else None
    if args.part != "all":
        return Runbook(args.part, args).run(only)
    rc, out = 0, args.out
    for part in PARTS:  # both commands, each into its own folder; labs names the library proof kept, as on the GPU
        args.out = os.path.join(out, part)
        rb = Runbook(part, args)
        rc |= rb.run(only)
        args.nccl = (rb.nccl or {}).get("kept", args.nccl)
    return rc


if __name__ == "__main__":
    sys.exit(main())
