#!/usr/bin/env python3
"""Prove dtlab's GPU path on a bare GPU machine, in one command, and write the figures to a JSON summary.

    python3 tools/gpu_runbook.py --wheels .whl --out gpu-proof          # on the GPU machine
    python3 tools/gpu_runbook.py --dry-run --wheels .whl --out /tmp/dry # anywhere: checks every step, runs small
    python3 tools/gpu_runbook.py --check-wheels --wheels .whl           # only check the wheel folder

The GPU machine is assumed to have python3 with torch (CUDA), transformers and the packages listed in
tools/gpu-device-packages.txt, and no package index. The wheel folder (tools/make_gpu_wheels.sh builds it on a
connected machine) carries the rest: DeepSpeed and the packages the labs need. Steps:

1. wheels:   every wheel of tools/gpu-wheels.txt is in the folder, once, for CPython 3.12 x86-64 Linux, and every
             requirement of every wheel is met by another wheel or by a package the machine already has;
2. install:  `pip install --no-index --no-deps --target SITE` of the folder; dtlab itself runs from this
             checkout (PYTHONPATH), so nothing is built on the machine;
3. doctor:   `python -m dtlab doctor --json`: GPUs, CUDA, NCCL, DeepSpeed, where each lab runs;
4. gpu-suite: `python -m pytest -m gpu -rs tests/test_gpu.py` (junit XML kept);
5. main-job: the README's main job (`dtlab run --model distilbert --steps 8 --batch-size 8 --seq-len 64`);
6. figures:  T_step, T_comp, T_comm, exposed, overlap, buckets and bytes per step, and dtlab vs NCCL / DDP timers,
             read from the main job's run directory;
7. zero3:    a ZeRO-3 run of DistilBERT (collectives per phase with bytes, memory per rank);
8. calibrate: all_reduce, reduce_scatter, all_gather at 2 ranks, alpha and beta with 95% intervals.

--dry-run runs the same steps on any machine: the wheel check is real, install only prints its command, and the
runs use the tiny model with few steps, so a CPU machine walks every step in about a minute.
Exit code 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from email.parser import Parser

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY_VERSION = "3.12"  # the GPU machines' python3


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _listed(path: str) -> list[str]:
    with open(path) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def check_wheels(folder: str) -> dict:
    """Check the wheel folder against tools/gpu-wheels.txt and the device's package list (see module doc)."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    wanted = {}
    for line in _listed(os.path.join(HERE, "gpu-wheels.txt")):
        name, _, version = line.partition("==")
        wanted[_norm(name)] = version
    device_has = {_norm(n) for n in _listed(os.path.join(HERE, "gpu-device-packages.txt"))}
    problems, found = [], {}
    if not os.path.isdir(folder):
        return {"ok": False, "problems": [f"wheel folder {folder!r} does not exist: build it with "
                                          "tools/make_gpu_wheels.sh on a machine that reaches PyPI"], "wheels": 0}
    for fn in sorted(os.listdir(folder)):
        if not fn.endswith(".whl"):
            continue
        parts = fn[:-4].split("-")
        name, version, tags = _norm(parts[0]), parts[1], "-".join(parts[-3:])
        if name in found:
            problems.append(f"{name}: two wheels ({found[name]['file']}, {fn}); keep one version")
        found[name] = {"file": fn, "version": version}
        py, abi, plat = parts[-3], parts[-2], parts[-1]
        abi3_ok = abi == "abi3" and all(t.startswith("cp3") and int(t[3:] or 0) <= 12 for t in py.split("."))
        if not (py in ("py3", "py2.py3") or "cp312" in py or abi3_ok):
            problems.append(f"{fn}: built for {py}, the GPU machine runs CPython {PY_VERSION}")
        if not (plat == "any" or ("x86_64" in plat and "linux" in plat)):
            problems.append(f"{fn}: platform {plat} is not x86-64 Linux")
        if abi not in ("none", "abi3") and "cp312" not in abi:
            problems.append(f"{fn}: ABI {abi} does not match CPython {PY_VERSION}")
        del tags
    for name, version in wanted.items():
        if name not in found:
            problems.append(f"{name}=={version}: missing")
        elif found[name]["version"] != version:
            problems.append(f"{name}: wheel is {found[name]['version']}, gpu-wheels.txt pins {version}")
    env = dict(default_environment(), python_version=PY_VERSION, python_full_version=f"{PY_VERSION}.3",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
               implementation_name="cpython", platform_python_implementation="CPython")
    unmet = set()
    for name, info in found.items():
        with zipfile.ZipFile(os.path.join(folder, info["file"])) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            reqs = Parser().parsestr(z.read(meta).decode("utf-8", "replace")).get_all("Requires-Dist") or []
        for r in reqs:
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            dep = _norm(req.name)
            if dep == "torch" or dep in found or dep in device_has:
                continue
            unmet.add(f"{dep} (needed by {name})")
    problems += [f"requirement not met by the folder or the machine: {u}" for u in sorted(unmet)]
    size = sum(os.path.getsize(os.path.join(folder, i["file"])) for i in found.values())
    return {"ok": not problems, "problems": problems, "wheels": len(found), "bytes": size}


class Runbook:
    def __init__(self, args):
        self.args, self.dry = args, args.dry_run
        self.out = os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        self.summary = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": self.dry, "steps": {}}
        self.site = os.path.join(self.out, "site")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
        paths = [ROOT] + ([self.site] if not self.dry else []) + [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env["PYTHONPATH"] = os.pathsep.join(paths)

    # ---- helpers ------------------------------------------------------------------------------------------
    def sh(self, name: str, cmd: list[str], timeout: int = 1800) -> subprocess.CompletedProcess:
        log = os.path.join(self.out, f"{name}.log")
        print(f"[{name}] $ {' '.join(cmd)}", flush=True)
        t0 = time.time()
        with open(log, "w") as f:
            cp = subprocess.run(cmd, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                stdin=subprocess.DEVNULL)
        with open(log) as f:
            tail = f.read()[-1500:]
        self.summary["steps"].setdefault(name, {}).update(cmd=" ".join(cmd), rc=cp.returncode,
                                                          seconds=round(time.time() - t0, 1), log=log)
        if cp.returncode != 0:
            print(tail, flush=True)
        return cp

    def step(self, name: str, ok: bool, **facts) -> bool:
        self.summary["steps"].setdefault(name, {}).update(ok=bool(ok), **facts)
        print(f"[{name}] {'ok' if ok else 'FAILED'}", flush=True)
        return ok

    # ---- the steps ----------------------------------------------------------------------------------------
    def wheels(self) -> bool:
        res = check_wheels(self.args.wheels)
        for p in res["problems"]:
            print(f"[wheels] {p}")
        ok = res.pop("ok")
        return self.step("wheels", ok, **res)

    def install(self) -> bool:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--upgrade", "--target", self.site] + sorted(
            os.path.join(self.args.wheels, f) for f in os.listdir(self.args.wheels) if f.endswith(".whl"))
        if self.dry:
            return self.step("install", True, cmd=" ".join(cmd[:12]) + " ...", note="dry run: not installed")
        return self.step("install", self.sh("install", cmd).returncode == 0)

    def doctor(self) -> bool:
        cp = self.sh("doctor", [sys.executable, "-m", "dtlab", "doctor", "--json", "--no-hub"], timeout=300)
        with open(os.path.join(self.out, "doctor.log")) as f:
            text = f.read()
        try:
            facts = json.loads(text[text.index("{"):])
        except ValueError:
            facts = {}
        self.summary["doctor"] = facts
        return self.step("doctor", cp.returncode == 0 and bool(facts), gpus=facts.get("gpus"),
                         nccl=facts.get("nccl"), torch=facts.get("torch"))

    def gpu_suite(self) -> bool:
        xml = os.path.join(self.out, "gpu-junit.xml")
        cp = self.sh("gpu-suite", [sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider",
                                   "tests/test_gpu.py", f"--junitxml={xml}"], timeout=3000)
        counts = {}
        if os.path.exists(xml):
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            counts["skip_reasons"] = sorted({s.get("message", "") for s in suite.iter("skipped")})
        ok = cp.returncode == 0 and counts.get("tests", 0) > 0
        if not self.dry:  # on a GPU machine the suite must really run, not skip
            ok = ok and counts.get("skipped", 0) < counts.get("tests", 0)
        return self.step("gpu-suite", ok, **counts)

    def main_job(self) -> bool:
        run_dir = os.path.join(self.out, "first")
        size = (["--model", "tiny", "--steps", "4", "--warmup", "1", "--batch-size", "4", "--seq-len", "32",
                 "--bucket-mb", "0.05", "--baseline-steps", "2"] if self.dry else
                ["--model", "distilbert", "--steps", "8", "--batch-size", "8", "--seq-len", "64"])
        cp = self.sh("main-job", [sys.executable, "-m", "dtlab", "run", *size, "--out", run_dir, "--no-progress"])
        if cp.returncode != 0:
            return self.step("main-job", False)
        sys.path.insert(0, ROOT)
        from dtlab.results import load_run
        run = load_run(run_dir)
        s = run.summary().set_index("quantity")["value"]
        per = run.buckets.groupby(["rank", "step"])["nbytes"].sum()
        steady = run.buckets[run.buckets["step"] >= run.warmup].groupby(["rank", "step"]).size()
        x = run.crosscheck()
        figs = {"placement": run.resolved.get("placement", {}).get("label"), "devices": run.resolved.get("devices"),
                "torch": run.resolved.get("versions", {}).get("torch"), "nccl": run.resolved.get("nccl"),
                "T_step_ms": s["T_step"] * 1e3, "T_comp_ms": s["T_comp"] * 1e3, "T_comm_ms": s["T_comm"] * 1e3,
                "exposed_ms": s["exposed"] * 1e3, "overlap": s["overlap"],
                "how": dict(zip(run.summary()["quantity"], run.summary()["how"])),
                "grad_bytes": run.resolved["grad_bytes"], "bytes_per_rank_step": sorted(set(per.tolist())),
                "buckets_per_step": sorted(set(steady.tolist())),
                "crosscheck": json.loads(x.to_json(orient="records"))}
        self.summary["main_job"] = figs
        return self.step("main-job", set(per.tolist()) == {run.resolved["grad_bytes"]}, run_dir=run_dir)

    def zero3(self) -> bool:
        run_dir = os.path.join(self.out, "zero3")
        size = (["--model", "tiny", "--steps", "3", "--warmup", "1", "--batch-size", "4", "--seq-len", "32"]
                if self.dry else ["--model", "distilbert", "--steps", "6", "--batch-size", "8", "--seq-len", "64"])
        cp = self.sh("zero3", [sys.executable, "-m", "dtlab", "run", "--strategy", "zero3", *size, "--out", run_dir,
                               "--no-progress"])
        if cp.returncode != 0:
            return self.step("zero3", False)
        from dtlab.results import load_run
        run = load_run(run_dir)
        c = run.collectives[run.collectives["step"] >= run.warmup]
        by = c.groupby(["phase", "op"])["nbytes"].sum() / max(1, c["step"].nunique() * run.nproc)
        self.summary["zero3"] = {
            "bytes_per_rank_step": {f"{p}/{o}": int(v) for (p, o), v in by.items()},
            "memory": json.loads(run.memory.to_json(orient="records")),
            "summary": json.loads(run.summary().to_json(orient="records")), "placement": run.resolved.get("placement")}
        return self.step("zero3", run.status.get("state") == "finished", run_dir=run_dir)

    def calibrate(self) -> bool:
        out = os.path.join(self.out, "profile")
        extra = ["--sizes", "4K,64K,1M,4M", "--iters", "2", "--rounds", "1"] if self.dry else []
        cp = self.sh("calibrate", [sys.executable, "-m", "dtlab", "calibrate", "--nproc", "2", "--ops",
                                   "all_reduce,reduce_scatter,all_gather", *extra, "--out", out, "--no-progress"])
        if cp.returncode != 0:
            return self.step("calibrate", False)
        from dtlab.model.profile import load_profile
        prof = load_profile(out)
        self.summary["calibration"] = {op: {"alpha_us": f.alpha * 1e6, "alpha_ci_us": [a * 1e6 for a in f.alpha_ci],
                                            "busbw_GBps_from_beta": (1 / f.beta / 1e9) if f.beta > 0 else None,
                                            "form": f.form, "rel_rms": f.rel_rms}
                                       for op, f in prof.fits.items()}
        self.summary["calibration"]["timing"] = prof.meta.get("timing")
        return self.step("calibrate", bool(prof.fits))

    def run(self) -> int:
        ok = self.wheels()
        if self.args.check_wheels:
            return 0 if ok else 1
        if ok or self.dry:
            ok = self.install() and ok
        for fn in (self.doctor, self.gpu_suite, self.main_job, self.zero3, self.calibrate):
            try:
                ok = fn() and ok
            except Exception as e:  # noqa: BLE001 - one failed step must not hide the others' figures
                ok = self.step(fn.__name__.replace("_", "-"), False, error=f"{type(e).__name__}: {e}") and ok
        self.summary["ok"] = ok
        path = os.path.join(self.out, "summary.json")
        with open(path, "w") as f:
            json.dump(self.summary, f, indent=2, default=str)
        print(f"summary: {path} ({'all steps passed' if ok else 'some steps FAILED'})")
        return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="wheel folder (default .whl)")
    ap.add_argument("--out", default="gpu-proof", help="where logs, runs and summary.json go")
    ap.add_argument("--dry-run", action="store_true", help="check every step, install nothing, run small")
    ap.add_argument("--check-wheels", action="store_true", help="only check the wheel folder")
    args = ap.parse_args(argv)
    if args.check_wheels:
        res = check_wheels(args.wheels)
        for p in res["problems"]:
            print(p)
        print(f"{res['wheels']} wheels, {res.get('bytes', 0) / 2**20:.1f} MiB: {'ok' if res['ok'] else 'NOT ok'}")
        return 0 if res["ok"] else 1
    return Runbook(args).run()


if __name__ == "__main__":
    sys.exit(main())
