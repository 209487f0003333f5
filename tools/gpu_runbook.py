#!/usr/bin/env python3
"""Prove dtlab's GPU path on a bare GPU machine in four short commands, each under 600 s with margin.

    python3 tools/gpu_runbook.py suite --wheels .whl --nccl .nccl --out $OUT  # the NCCL proof, install, the
                                  # README's main job, ZeRO-3, a 3-op calibration, doctor, the GPU suite, the overhead
    python3 tools/gpu_runbook.py labs  --wheels .whl --nccl .nccl --out $OUT  # labs 00-05 in quick mode, the
                                                                              # model's error
    python3 tools/gpu_runbook.py labs-more --wheels .whl --nccl .nccl --out $OUT  # labs 06-10 in quick mode
    python3 tools/gpu_runbook.py labs-last --wheels .whl --nccl .nccl --out $OUT  # labs 11 onward in quick mode
    python3 tools/gpu_runbook.py all --dry-run --wheels .whl --nccl .nccl --out /tmp/dry  # anywhere: every part, small
    python3 tools/gpu_runbook.py check-wheels --wheels .whl                   # only the wheel folder

`--nccl DIR` (optional; `python3 tools/nccl_prepare.py` makes the git-ignored `.nccl/` from the shared NCCL 2.30.7
build): DIR's libnccl.so.2 (decompressed there from a carried libnccl.so.2.xz if need be) is checked against
libnccl.so.2.sha256 and named in every step's DTLAB_NCCL_LIBRARY, so dtlab preloads it into NCCL ranks; the
suite's first step, nccl-proof (tools/nccl_proof.py), records which library each of two ranks sharing cuda:0 loaded
(ncclGetVersion), NCCL's own "NCCL version" lines and a tiny all_reduce (on a dry run or without CUDA, the versions
only, saying CUDA was skipped).

Made for machines reached through short remote commands (at most 600 s each; at most 8 files, 2 folders deep,
come back from the output folder; the working tree and the carried wheel folder travel, 64 MiB in all):

- each part stops starting steps when its budget (BUDGET_S = 540 s, 60 s under the limit) runs short: a step's
  timeout is its cap (STEP_CAP) or what is left, and a step that cannot get MIN_STEP_S is skipped, saying so;
- `--out` stays small and flat: `summary.json`, rewritten after every step (a command cut off still leaves the
  figures of every finished step), `logs.tar.gz` (every step's log, the runs' small files and the executed labs,
  also rewritten after every step), for suite `gpu-junit.xml` and for labs `labs.json` (per lab: seconds, the
  error outputs, every claim with its verdict, where its runs were placed);
- the runs go to `--work` and the packages to `--site` (default /tmp/dtlab-site), both outside `--out`. Every part
  installs the wheel folder there if it is not already (`pip --no-index --no-deps --target`, never touching the
  machine's torch), so the parts run in any order and on a fresh machine; without `--work`, each invocation
  works in a new folder, so a part run again on the same machine runs again;
- dtlab itself runs from this checkout: its path is set before any step, so one failed step loses no later
  figure.

The GPU machine is assumed to have python3 with torch (CUDA), transformers and the packages listed in
tools/gpu-device-packages.txt, and no package index; tools/make_gpu_wheels.sh builds the folder elsewhere and
tools/gpu_wheels.py checks it. `--dry-run` walks every step on any machine: the wheel check is real, nothing is
installed, the runs use the tiny model and the labs are planned (each lab's placements and its time cap), not
executed. Exit code 0 when every step passed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
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
from nccl_prepare import ready as nccl_ready  # noqa: E402

from dtlab.config.ncclib import ENV as NCCL_LIBRARY_ENV  # noqa: E402

COMMAND_LIMIT_S = 600  # what one remote command may run
BUDGET_S = 540  # what a part plans for: the rest is margin for Python's start and the last archive
MIN_STEP_S = 20  # a step that cannot get this long is skipped, not started
RESERVE_S = 10  # kept back from each step's timeout for writing the summary and the archive
MAX_FILES, MAX_DEPTH = 8, 2
#: Each part's steps in order. The suite puts NCCL first: with --nccl, "nccl-proof" (which library two ranks on
#: one GPU load) before anything else, then the runs that show NCCL's shared-GPU mode (DDP, ZeRO-3, calibration)
#: ahead of the doctor, the GPU suite and the recorder's overhead, so a command cut short keeps those first.
PARTS = {
    "suite": (
        "nccl-proof",
        "wheels",
        "install",
        "deps",
        "main-job",
        "zero3",
        "calibrate",
        "doctor",
        "gpu-suite",
        "overhead",
    ),
    "labs": ("install", "labs", "model-error"),
    "labs-more": ("install", "labs-more"),
    "labs-last": ("install", "labs-last"),
}
#: Steps that run only when asked for by an option (the option's name): without --nccl there is nothing to prove.
OPTIONAL = {"nccl-proof": "nccl"}
#: which labs each lab step runs, by the lab's number: an H100 took 406 s for labs 00-08, more than one command's
#: labs step, and labs 10 to 12 have no GPU record (each planned at the cap), so the labs are three steps in three
#: parts (a new lab lands in the last)
LAB_STEPS = {
    "labs": lambda number: number <= 5,
    "labs-more": lambda number: 6 <= number <= 10,
    "labs-last": lambda number: number >= 11,
}
STEP_CAP = {
    "nccl-proof": 90,
    "wheels": 60,
    "install": 180,
    "deps": 90,
    "doctor": 150,
    "gpu-suite": 300,
    "main-job": 120,
    "zero3": 120,
    "overhead": 150,
    "calibrate": 120,
    "labs": 300,
    "labs-more": 500,
    "labs-last": 500,
    "model-error": 200,
}
LAB_CAP_S = 120  # one lab in quick mode (an H100 took 16-75 s for each of labs 00-08; tools/gpu-lab-seconds.json)
ARCHIVED = (".log", ".json", ".jsonl", ".xml", ".txt", ".ipynb")
ARCHIVE_FILE_MAX = 8 * 2**20


def step_timeout(cap: float, remaining: float) -> float | None:
    """Seconds a step may run: its cap or what is left of the budget less RESERVE_S; None when under MIN_STEP_S."""
    t = min(cap, remaining - RESERVE_S)
    return t if t >= MIN_STEP_S else None


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


def _folder_bytes(folder: str) -> int:
    """Bytes of the files directly in `folder` (the NCCL folder: a library, its .xz, its sha256)."""
    return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file()) if os.path.isdir(folder) else 0


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


class Runbook:
    """One part: its steps in order, each recorded in summary.json as soon as it ends."""

    def __init__(self, part: str, args):
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
        self.t0, self.budget = time.monotonic(), float(args.budget)
        self.summary = {
            "part": part,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "dry_run": self.dry,
            "limits": {
                "command_s": COMMAND_LIMIT_S,
                "budget_s": self.budget,
                "max_files": MAX_FILES,
                "max_depth": MAX_DEPTH,
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
        if not self.dry and self._installed():
            self._use_site()

    def _nccl(self, folder: str | None) -> dict | None:
        """With --nccl: the folder's libnccl.so.2 (decompressed from a carried .xz if need be) checked against its
        sha256; when it passes, every step's environment names it in DTLAB_NCCL_LIBRARY (dtlab preloads it into NCCL
        ranks). Recorded in the summary either way."""
        if not folder:
            return None
        res = nccl_ready(folder)
        if res["ok"]:
            self.env[NCCL_LIBRARY_ENV] = res["path"]
        self.summary["nccl"] = {**res, "env": {NCCL_LIBRARY_ENV: res["path"]} if res["ok"] else {}}
        return res

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
        """Every step log and the runs' small files (no checkpoints), as one archive in --out."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for d, dirs, names in os.walk(self.work):
                dirs[:] = sorted(x for x in dirs if x not in ("checkpoints", "__pycache__"))
                for n in sorted(names):
                    p = os.path.join(d, n)
                    if n.endswith(ARCHIVED) and os.path.getsize(p) <= ARCHIVE_FILE_MAX:
                        tar.add(p, arcname=os.path.relpath(p, self.work))
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
            try:
                rc = subprocess.run(
                    cmd,
                    cwd=cwd,
                    env=env or self.env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                    stdin=subprocess.DEVNULL,
                ).returncode
            except subprocess.TimeoutExpired:
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

    def _installed(self) -> bool:
        stamp = os.path.join(self.site, ".dtlab-wheels.json")
        try:
            with open(stamp) as f:
                return json.load(f) == self._wheel_names()
        except (OSError, ValueError):
            return False

    def _wheel_names(self) -> list:
        w = self.args.wheels
        return sorted(f for f in os.listdir(w) if f.endswith(".whl")) if os.path.isdir(w) else []

    def _use_site(self) -> None:
        import importlib

        if self.site not in sys.path:
            sys.path.insert(1, self.site)
        sys.path_importer_cache.pop(self.site, None)
        importlib.invalidate_caches()

    # ---- the steps ----------------------------------------------------------------------------------------
    def wheels(self, timeout) -> bool:
        res = check_wheels(self.args.wheels)
        for p in res["problems"]:
            print(f"[wheels] {p}")
        size = tree_bytes(ROOT)
        nccl = _folder_bytes(self.nccl["folder"]) if self.nccl else 0  # carried beside the wheels
        if size + res.get("bytes", 0) + nccl > TREE_MAX_BYTES:
            res["ok"] = False
            res["problems"].append(
                f"the tree, the wheels and the NCCL folder come to {(size + res.get('bytes', 0) + nccl) / 2**20:.1f} "
                f"MiB, over the {TREE_MAX_BYTES / 2**20:.0f} MiB that travel: carry the library's .xz instead "
                "(tools/nccl_prepare.py --xz-only; the runbook decompresses it)"
            )
            print(f"[wheels] {res['problems'][-1]}")
        return self.record(
            "wheels",
            res.pop("ok"),
            tree_bytes=size,
            nccl_bytes=nccl,
            travels_mib=round((size + res.get("bytes", 0) + nccl) / 2**20, 1),
            **res,
        )

    def install(self, timeout) -> bool:
        names = self._wheel_names()
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--upgrade",
            "--target",
            self.site,
        ] + [os.path.join(self.args.wheels, n) for n in names]
        if self.dry:
            return self.record("install", True, cmd=" ".join(cmd[:12]) + " ...", note="dry run: not installed")
        if self._installed():
            return self.record("install", True, note=f"already installed in {self.site} ({len(names)} wheels)")
        if not names:
            return self.record("install", False, error=f"no wheels in {self.args.wheels}")
        ok = self.sh("install", cmd, timeout) == 0
        if ok:
            with open(os.path.join(self.site, ".dtlab-wheels.json"), "w") as f:
                json.dump(names, f)
            self._use_site()
        return self.record("install", ok, wheels=len(names))

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
        cmd += ["--timeout", str(round(max(10.0, timeout - 15)))] + (["--no-cuda"] if self.dry else [])
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

    def gpu_suite(self, timeout) -> bool:
        xml = os.path.join(self.out, "gpu-junit.xml")
        rc = self.sh(
            "gpu-suite",
            [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-rs",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/gpu",
                f"--junitxml={xml}",
            ],
            timeout,
        )
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
        if not self.dry:  # on a GPU machine the suite must really run, not skip
            ok = ok and counts.get("skipped", 0) < counts.get("tests", 0)
        return self.record("gpu-suite", ok, **counts)

    def main_job(self, timeout) -> bool:
        from runbook_figures import ddp_figures

        run_dir = os.path.join(self.work, "first")
        size = (
            [
                "--model",
                "tiny",
                "--steps",
                "4",
                "--warmup",
                "1",
                "--batch-size",
                "4",
                "--seq-len",
                "32",
                "--bucket-mb",
                "0.05",
                "--baseline-steps",
                "2",
            ]
            if self.dry
            else ["--model", "distilbert", "--steps", "8", "--batch-size", "8", "--seq-len", "64"]
        )
        if (
            self.sh(
                "main-job", [sys.executable, "-m", "dtlab", "run", *size, "--out", run_dir, "--no-progress"], timeout
            )
            != 0
        ):
            return self.record("main-job", False)
        self.summary["main_job"], ok = ddp_figures(run_dir)
        return self.record("main-job", ok, run_dir=run_dir)

    def zero3(self, timeout) -> bool:
        from runbook_figures import zero3_figures

        run_dir = os.path.join(self.work, "zero3")
        size = (
            ["--model", "tiny", "--steps", "3", "--warmup", "1", "--batch-size", "4", "--seq-len", "32"]
            if self.dry
            else ["--model", "distilbert", "--steps", "6", "--batch-size", "8", "--seq-len", "64"]
        )
        if (
            self.sh(
                "zero3",
                [sys.executable, "-m", "dtlab", "run", "--strategy", "zero3", *size, "--out", run_dir, "--no-progress"],
                timeout,
            )
            != 0
        ):
            return self.record("zero3", False)
        self.summary["zero3"], ok = zero3_figures(run_dir)
        return self.record("zero3", ok, run_dir=run_dir)

    def calibrate(self, timeout) -> bool:
        from runbook_figures import calibration_figures

        out = os.path.join(self.work, "profile")
        sizes = "4K,64K,1M,4M" if self.dry else ",".join(f"{2**k}" for k in range(12, 26))  # 4 KiB .. 32 MiB
        extra = ["--iters", "2", "--rounds", "1"] if self.dry else ["--iters", "8", "--rounds", "2"]
        if (
            self.sh(
                "calibrate",
                [
                    sys.executable,
                    "-m",
                    "dtlab",
                    "calibrate",
                    "--nproc",
                    "2",
                    "--ops",
                    "all_reduce,reduce_scatter,all_gather",
                    "--sizes",
                    sizes,
                    *extra,
                    "--out",
                    out,
                    "--no-progress",
                ],
                timeout,
            )
            != 0
        ):
            return self.record("calibrate", False)
        self.summary["calibration"], ok = calibration_figures(out)
        return self.record("calibrate", ok, profile=out)

    def labs(self, timeout) -> bool:
        """Labs 00-05 top to bottom in quick mode (`_labs`)."""
        return self._labs("labs", timeout)

    def labs_more(self, timeout) -> bool:
        """Labs 06-10 top to bottom in quick mode (`_labs`)."""
        return self._labs("labs-more", timeout)

    def labs_last(self, timeout) -> bool:
        """Labs 11 onward top to bottom in quick mode (`_labs`)."""
        return self._labs("labs-last", timeout)

    def _plan(self, step: str) -> dict:
        """{notebook: its placements, cap and planned seconds} for the labs of lab step `step`: each lab planned
        at its slowest clean time on a GPU (runbook_figures.recorded_lab_seconds), or at the per-lab cap where
        no record times it, saying so."""
        from runbook_figures import lab_plan, recorded_lab_seconds

        names = sorted(
            n for n in os.listdir(os.path.join(ROOT, "labs")) if n.endswith(".ipynb") and LAB_STEPS[step](int(n[:2]))
        )
        seconds = recorded_lab_seconds()
        plan = {}
        for n in names:
            known = seconds.get(n)
            plan[n] = {
                "placed": lab_plan(n),
                "cap_s": LAB_CAP_S,
                "planned_s": known["seconds"] if known else LAB_CAP_S,
                "from": f"the slowest clean record ({known['record']})" if known else "no clean GPU record: the cap",
            }
        return plan

    def _labs(self, step: str, timeout) -> bool:
        """Each lab of `step` top to bottom in quick mode, each in a fresh folder; labs.json in --out after every
        lab. A dry run plans them (placements and planned seconds) and executes none."""
        plan = self._plan(step)
        planned_s = round(sum(p["planned_s"] for p in plan.values()), 1)
        if self.dry:
            refused = [n for n, p in plan.items() if any(x["label"].startswith("cannot run") for x in p["placed"])]
            ok = not refused and bool(plan) and planned_s <= STEP_CAP[step] - RESERVE_S
            return self.record(
                step,
                ok,
                planned=plan,
                refused=refused,
                planned_s=planned_s,
                note="dry run: planned, not executed (tests/e2e/test_notebooks.py executes them on CPU)",
            )
        record, t_end = {}, time.monotonic() + timeout
        for n in plan:
            left = t_end - time.monotonic()
            if left < MIN_STEP_S:
                record[n] = {
                    "skipped": f"{left:.0f} s left of the {step} step: not started",
                    "placed": plan[n]["placed"],
                }
                continue
            record[n] = self._one_lab(n, min(LAB_CAP_S, left), plan[n]["placed"])
            self._write_json("labs.json", record)
        self._write_json("labs.json", record)
        failed = sorted(n for n, r in record.items() if r.get("rc") != 0)
        contradicted = sorted(
            c["cid"] for r in record.values() for c in r.get("claims", []) if c.get("outcome") == "contradicted"
        )
        return self.record(
            step,
            not failed,
            failed=failed,
            contradicted=contradicted,
            planned_s=planned_s,
            seconds={n: r.get("seconds") for n, r in record.items()},
        )

    def _one_lab(self, n: str, timeout: float, placed: list) -> dict:
        """Lab notebook `n` executed in quick mode in its own folder: its record (errors, claims, rc, seconds,
        placements, runs)."""
        from runbook_figures import lab_record, lab_runs

        where = os.path.join(self.work, "labs", n[: -len(".ipynb")])
        os.makedirs(where, exist_ok=True)
        executed = os.path.join(self.work, "labs", n)
        t0 = time.monotonic()
        rc = self.sh(
            f"lab-{n[:2]}",
            [
                sys.executable,
                os.path.join(HERE, "run_notebook.py"),
                os.path.join(ROOT, "labs", n),
                where,
                "--save",
                executed,
            ],
            timeout,
            env=dict(self.env, DTLAB_QUICK="1"),
        )
        return {
            **lab_record(executed),
            "rc": rc,
            "seconds": round(time.monotonic() - t0, 1),
            "placed": placed,
            "runs": lab_runs(where),
        }

    def _write_json(self, name: str, doc) -> None:
        tmp = os.path.join(self.out, f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.out, name))

    def _benchmark(self, name: str, script: str, args: list, timeout) -> tuple[bool, dict]:
        """Run benchmarks/SCRIPT with --json; (ok, its figures). A dry run only checks that it starts (--help)."""
        path = os.path.join(ROOT, "benchmarks", script)
        if self.dry:
            return self.sh(name, [sys.executable, path, "--help"], timeout) == 0, {
                "note": "dry run: planned, not run (measured on the GPU)",
                "args": args,
            }
        out = os.path.join(self.work, f"{name}.json")
        if self.sh(name, [sys.executable, path, *args, "--json", out], timeout) != 0:
            return False, {}
        with open(out) as f:
            return True, json.load(f)

    def overhead(self, timeout) -> bool:
        """The recorder's overhead on this machine: the README's job with recording on and off, interleaved."""
        ok, figs = self._benchmark(
            "overhead", "recorder_overhead.py", ["--pairs", "3", "--model", "distilbert", "--steps", "6"], timeout
        )
        if ok and not self.dry:
            figs = {
                "overhead": figs["overhead"],
                "plain_T_step_ms": [t * 1e3 for t in figs["plain_s"]],
                "recorded_T_step_ms": [t * 1e3 for t in figs["recorded_s"]],
                "pairs": 3,
            }
        self.summary["overhead"] = figs
        return self.record("overhead", ok)

    def model_error(self, timeout) -> bool:
        """benchmarks/model_error.py: the alpha-beta model's T_step and T_comm errors on this machine."""
        ok, figs = self._benchmark(
            "model-error", "model_error.py", ["--model", "distilbert", "--buckets", "1,25", "--steps", "6"], timeout
        )
        if ok and not self.dry:
            figs = {"held_out": figs["collectives"].get("rows"), "ddp": figs["ddp"]}
        self.summary["model_error"] = figs
        return self.record("model-error", ok)

    # ---- the part -----------------------------------------------------------------------------------------
    def run(self, only=None) -> int:
        steps = [
            s
            for s in PARTS[self.part]
            if (only is None or s in only) and (s not in OPTIONAL or getattr(self.args, OPTIONAL[s], None))
        ]
        self.summary["planned"] = steps
        self.write()
        ok = True
        for name in steps:
            timeout = step_timeout(STEP_CAP[name], self.remaining())
            if timeout is None:
                ok = (
                    self.record(
                        name,
                        False,
                        skipped=f"{self.remaining():.0f} s left of this command's "
                        f"{self.budget:.0f} s budget: not started",
                    )
                    and ok
                )
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=[*PARTS, "all", "check-wheels"])
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="wheel folder (default .whl)")
    ap.add_argument("--out", default="gpu-proof", help="summary.json and logs.tar.gz go here (keep it $OUT)")
    ap.add_argument(
        "--site",
        default=os.path.join(tempfile.gettempdir(), "dtlab-site"),
        help="where the wheels are installed (outside --out)",
    )
    ap.add_argument(
        "--work",
        default=None,
        help="run directories and logs (default: a new "
        "TMP/dtlab-gpu-work/PART-TIME-PID each invocation; a folder given here must not hold its runs yet)",
    )
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds a part plans for (default {BUDGET_S})")
    ap.add_argument(
        "--nccl",
        default=None,
        help="a folder holding libnccl.so.2 (or its .xz) and libnccl.so.2.sha256 (tools/nccl_prepare.py makes .nccl): "
        "checked, named in every step's DTLAB_NCCL_LIBRARY, and proven first by the suite's nccl-proof step",
    )
    ap.add_argument("--steps", default=None, help="only these steps of the part, comma-separated")
    ap.add_argument("--dry-run", action="store_true", help="check every step, install nothing, run small")
    args = ap.parse_args(argv)
    if args.part == "check-wheels":
        res = check_wheels(args.wheels)
        for p in res["problems"]:
            print(p)
        print(f"{res['wheels']} wheels, {res.get('bytes', 0) / 2**20:.1f} MiB: {'ok' if res['ok'] else 'NOT ok'}")
        return 0 if res["ok"] else 1
    only = set(args.steps.split(",")) if args.steps else None
    if args.part != "all":
        return Runbook(args.part, args).run(only)
    rc, out = 0, args.out
    for part in PARTS:  # every part, each into its own folder
        args.out = os.path.join(out, part)
        rc |= Runbook(part, args).run(only)
    return rc


if __name__ == "__main__":
    sys.exit(main())
