"""`dtlab doctor`: what this machine can run, and how each lab will run on it.

`facts()` gathers the facts; GPU names, CUDA, NCCL and DeepSpeed are read in a short-lived child process
(`python -m dtlab.cli.doctor --probe`), so a notebook kernel that calls the doctor never initialises CUDA or pays
for importing DeepSpeed. `report(facts)` turns them into text; `smoke_allreduce()` runs a real 2-rank
all-reduce through the same launcher as every run (about 10 s). Lab 00 calls all three.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version

from dtlab.config.busy import sample, sample_words
from dtlab.config.calibration import CalibConfig
from dtlab.config.models import hub_reachable
from dtlab.config.ncclib import ENV as NCCL_LIBRARY_ENV
from dtlab.config.ncclib import ranks_library
from dtlab.config.nvml import gpu_lines
from dtlab.config.placement import TIMING, nccl_allows_shared_gpu, torch_nccl_header
from dtlab.config.run import RunConfig
from dtlab.course.sandbox import available
from dtlab.results.status import RunFailed


def lab_files(labs_dir: str | None = None) -> list[str]:
    """The lab notebooks' stems ("00_setup_check", ...) in `labs_dir` (default: the checkout's labs/), sorted;
    where there is no labs/ folder (an installed package), the labs dtlab.course.labs.LABS describes."""
    from dtlab.course.labs import LABS

    labs_dir = labs_dir or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "labs")
    if os.path.isdir(labs_dir):
        stems = sorted(f[:-6] for f in os.listdir(labs_dir) if f.endswith(".ipynb") and f[:2].isdigit())
        if stems:
            return stems
    return [f"{k}_{v[0]}" for k, v in sorted(LABS.items())]


def probe() -> dict:
    """Facts that need torch (and CUDA, if present) imported. Run in a child process by `facts()`."""

    out: dict = {"python": platform.python_version(), "executable": sys.executable}
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001
        return {**out, "torch_error": f"{type(e).__name__}: {e}"}
    out.update(
        torch=torch.__version__,
        cuda_build=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        gloo=dist.is_available() and dist.is_gloo_available(),
        nccl_backend=dist.is_available() and dist.is_nccl_available(),
        gpus=[],
        nccl=None,
    )
    if out["cuda_available"]:
        out["gpus"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(torch.cuda.device_count())
        ]
    out.update(nccl_facts(out["cuda_available"]))
    for name in ("transformers", "datasets", "deepspeed", "plotly", "ipywidgets"):
        out[name] = _version(name)
    out["deepspeed_import"] = _try_import_deepspeed() if out["deepspeed"] else "not installed"
    return out


def nccl_facts(cuda: bool) -> dict:
    """The ranks' NCCL library (dtlab.config.ncclib.ranks_library: path, ncclGetVersion, where it was found) and
    torch's NCCL header version, read after torch is imported; `nccl` is the version placement uses: the library's,
    or the header's where no library is found (on a machine with CUDA only)."""
    out: dict = {"nccl_header": torch_nccl_header(), "nccl_library": None}
    try:
        lib = ranks_library()
        out["nccl_library"] = lib.to_dict() if lib is not None else None
    except ValueError as e:  # a DTLAB_NCCL_LIBRARY that names no NCCL library
        out["nccl_library_error"] = str(e)
    out["nccl"] = (out["nccl_library"] or {}).get("version") or out["nccl_header"] if cuda else None
    return out


def _version(name: str):
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _try_import_deepspeed() -> str:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if _cuda() else "cpu")
    t0 = time.perf_counter()
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"import failed: {type(e).__name__}: {e}"
    return f"ok ({time.perf_counter() - t0:.1f} s to import, accelerator {os.environ['DS_ACCELERATOR']})"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def facts(timeout_s: float = 120.0, check_hub: bool = True) -> dict:
    """Everything `report` prints, as a dict (JSON-safe). The torch/CUDA/DeepSpeed part runs in a child; the
    machine's load is sampled first, for half a second, before the child adds its own (dtlab.config.busy)."""

    load = sample(0.5)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    try:
        cp = subprocess.run(
            [sys.executable, "-m", "dtlab.cli.doctor", "--probe"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        lines = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
        found = json.loads(lines[-1]) if lines else {"probe_error": (cp.stderr or cp.stdout)[-2000:]}
    except subprocess.TimeoutExpired:
        found = {"probe_error": f"probe did not answer within {timeout_s:g} s"}
    found["cpu_cores"] = os.cpu_count()
    found["machine_load"] = load
    found["gpu_state"] = load.get("gpus")  # NVML's view (None without a driver): who else is on each GPU
    if check_hub:
        found["hub_reachable"] = hub_reachable()
        found["hub_offline_env"] = os.environ.get("HF_HUB_OFFLINE", "")
    found["labs"] = lab_placements(len(found.get("gpus", [])), found.get("nccl"))

    found["sandbox"] = available()  # {mechanism: None if dtlab grade can use it here, else why not}
    return found


def lab_placements(ngpu: int, nccl, labs_dir: str | None = None) -> dict:
    """For every lab notebook in labs/: where each of its runs places its ranks on a machine with `ngpu` GPUs
    and this NCCL ({"NN title": {"label", "note", "timing", "parts": [{what, label, note, timing}]}}), from the
    configs the lab itself builds (dtlab.course.labs). A lab dtlab.course.labs does not describe says so."""
    from dtlab.course.labs import LABS, lab_parts

    out = {}
    for stem in lab_files(labs_dir):
        if stem[:2] not in LABS:
            out[stem] = {
                "label": "not described in dtlab.course.labs.LABS: where it runs is unknown",
                "note": "",
                "timing": "",
                "parts": [],
            }
            continue
        parts = lab_parts(stem[:2], ngpu, nccl)
        out[f"{stem[:2]} {LABS[stem[:2]][0]}"] = {
            **{k: parts[0][k] for k in ("label", "note", "timing")},
            "parts": parts,
        }
    return out


#: The machines docs/gpus.md describes: (column title, GPUs, NCCL version).
DOC_MACHINES = (
    ("CPU machine", 0, None),
    ("1 GPU, NCCL 2.28.9 (torch 2.11's)", 1, "2.28.9"),
    ("1 GPU, NCCL >= 2.30", 1, "2.30.1"),
    ("8 GPUs", 8, "2.28.9"),
)


def _short(q: dict) -> str:
    if "backend" not in q:
        return q["label"]
    n, per = q["nproc"], q["ranks_per_gpu"]
    if q.get("nnodes", 1) > 1:  # emulated nodes: every node's ranks on this machine's same devices
        where = "CPU" if q["device"] == "cpu" else "CUDA tensors, all on GPU 0"
        return f"{q['nnodes']} nodes x {n} {q['backend'] if q['device'] == 'cuda' else 'gloo'}, {where}"
    if q["device"] == "cpu":
        return f"{n} gloo, CPU"
    if q["backend"] == "nccl":
        return f"{n} NCCL, {'1 GPU each' if per == 1 else f'{per} per GPU (multi-rank)'}"
    return f"{n} gloo, CUDA tensors, {per} per GPU"


def labs_markdown(machines=DOC_MACHINES, quick: bool = False) -> str:
    """Every lab's launches and where their ranks go on each machine, as the Markdown table docs/gpus.md holds
    (a test keeps the page equal to this)."""
    from dtlab.course.labs import LABS, lab_parts

    rows = [
        "| lab | launch | " + " | ".join(m[0] for m in machines) + " |",
        "| --- | --- | " + " | ".join("---" for _ in machines) + " |",
    ]
    for key, (title, _) in sorted(LABS.items()):
        cols = [lab_parts(key, ngpu, nccl, quick=quick) for _, ngpu, nccl in machines]
        for i, part in enumerate(cols[0]):
            what = part["what"] if cols[1][i]["what"] == part["what"] else "?"
            rows.append(
                f"| {key + ' ' + title if i == 0 else ''} | {what} | " + " | ".join(_short(c[i]) for c in cols) + " |"
            )
    return "\n".join(rows)


def timing_markdown() -> str:
    """How times are taken on each path, in the words every screen uses (dtlab.config.placement.TIMING)."""

    names = {"wall": "CPU machine (gloo)", "nccl": "NCCL on CUDA", "gloo_cuda": "gloo on CUDA tensors"}
    return "\n".join(f"- **{names[k]}**: {v}." for k, v in TIMING.items())


def doc_blocks() -> dict:
    """The generated blocks of docs/gpus.md, by marker name."""
    return {"labs table": labs_markdown(), "timing words": timing_markdown()}


def nccl_upgrade_lines(cuda_build, torch_version, nccl) -> list:
    """How to get NCCL >= 2.30 under this torch, so two NCCL ranks can share a GPU instead of gloo on CUDA tensors.

    Two ways: DTLAB_NCCL_LIBRARY names a libnccl.so.2 of NCCL >= 2.30 (dtlab preloads it into NCCL ranks, LD_PRELOAD,
    and each rank checks it loaded it), or a newer `nvidia-nccl-cuXX` wheel replaces the library torch's CUDA wheels
    load (torch 2.11.0+cu130 pins nvidia-nccl-cu13==2.28.9; pip installs it and warns). The check is the library's own
    version (ncclGetVersion, which `dtlab doctor` reads), never `torch.cuda.nccl.version()`: that is the header torch
    was compiled with and stays `nccl` (torch's) whichever library is loaded."""
    major = str(cuda_build or "").split(".")[0]
    wheel = f"nvidia-nccl-cu{major}" if major.isdigit() else "nvidia-nccl-cuXX (XX: this torch's CUDA major)"
    return [
        f"    to let 2 NCCL ranks share a GPU, give the ranks NCCL >= 2.30 built for CUDA {major or '?'}: either "
        f"{NCCL_LIBRARY_ENV}=/path/to/libnccl.so.2 (dtlab preloads it into NCCL ranks and each rank checks it "
        "loaded it),",
        f"    or pip install '{wheel}>=2.30' (a ~216 MB wheel: it replaces the library torch loads; pip then warns "
        f"that torch {torch_version or '?'} requires the NCCL {nccl} it shipped with: expected),",
        "    then check: `dtlab doctor` shows 'NCCL library ...: 2.30.x (ncclGetVersion)' and places 2 NCCL ranks per "
        "GPU (NCCL_MULTI_RANK_GPU_ENABLE=1, set by dtlab); torch.cuda.nccl.version() cannot tell: it reports the "
        f"header torch was compiled with ({nccl}) whichever library is loaded",
    ]


def nccl_lines(f: dict) -> list:
    """The NCCL library the ranks will load and torch's header, a warning when they differ, whether two ranks may
    share a GPU, and how to get an NCCL that lets them."""
    lib, header, nccl = f.get("nccl_library"), f.get("nccl_header"), f.get("nccl")
    if lib:
        lines = [
            f"  NCCL library {lib['path']}: {lib['version']} (ncclGetVersion); torch's header: {header or 'none'} "
            f"(the library: {lib.get('from', lib.get('source'))})"
        ]
        if header and lib["version"] != header:
            lines.append(
                f"  warning: the ranks' NCCL library ({lib['version']}) is not the NCCL torch was compiled with "
                f"({header}): torch.cuda.nccl.version() reports the header; dtlab places the ranks by the library"
            )
    else:
        lines = [
            f"  NCCL library: none found ({NCCL_LIBRARY_ENV} unset, none in LD_PRELOAD, none mapped by torch); "
            f"torch's header: {header or 'none'}" + (", used for placement instead" if header else "")
        ]
    if f.get("nccl_library_error"):
        lines.append(f"  NCCL library refused: {f['nccl_library_error']}")
    shared = nccl_allows_shared_gpu(nccl)
    lines.append(
        f"  NCCL {nccl or 'not found'}: two ranks per GPU "
        + (
            "allowed (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1, experimental)"
            if shared
            else "not allowed (needs NCCL >= 2.30); gloo on CUDA tensors is the fallback"
        )
    )
    if not shared and nccl:
        lines += nccl_upgrade_lines(f.get("cuda_build"), f.get("torch"), header or nccl)
    return lines


def report(f: dict) -> str:
    """The facts as text, one fact a line, each with its unit or its meaning."""
    gpus = f.get("gpus") or []
    lines = ["dtlab doctor"]
    if "probe_error" in f or "torch_error" in f:
        lines.append(f"  torch probe failed: {f.get('probe_error') or f.get('torch_error')}")
    lines += [
        f"  python {f.get('python', '?')}, torch {f.get('torch', '?')} (CUDA build {f.get('cuda_build')})",
        f"  CPU cores: {f.get('cpu_cores')}",
    ]
    if gpus:
        for i, g in enumerate(gpus):
            lines.append(f"  GPU {i}: {g['name']}, {g['memory_gib']} GiB")
        lines += nccl_lines(f)
    else:
        lines.append(
            "  GPUs: none visible to torch: every run uses gloo on the CPU"
            + ("" if f.get("cuda_build") is None else " (this torch is a CUDA build; no device or driver)")
        )
    lines += load_lines(f.get("machine_load"))
    if f.get("gpu_state") is not None or gpus:
        lines += ["  " + line for line in gpu_lines(f.get("gpu_state"))]
    lines.append(
        f"  backends: gloo {'yes' if f.get('gloo') else 'NO'}, nccl {'yes' if f.get('nccl_backend') else 'no'}"
    )
    lines.append(f"  deepspeed {f.get('deepspeed') or 'not installed'}: {f.get('deepspeed_import')}")
    lines.append(
        f"  transformers {f.get('transformers')}, datasets {f.get('datasets')}, "
        f"plotly {f.get('plotly')}, ipywidgets {f.get('ipywidgets')}"
    )
    if "hub_reachable" in f:
        lines.append(
            "  Hugging Face hub: "
            + (
                "reachable: real distilbert-base-uncased weights and GLUE SST-2"
                if f["hub_reachable"]
                else "not reachable (or HF_HUB_OFFLINE set): random-init DistilBERT and "
                "dtlab's offline SST-2-format data, labelled in every run"
            )
        )
    if "sandbox" in f:
        lines.append(sandbox_line(f["sandbox"]))
    lines.append("  where each lab's ranks run:")
    parts = [q for p in f.get("labs", {}).values() for q in p.get("parts", [])]
    for lab, p in f.get("labs", {}).items():
        lines.append(f"    {lab}")
        for q in p.get("parts") or [{"what": "?", "label": p["label"]}]:
            lines.append(f"        {q['what']}: {q['label']}")
    for n in sorted({q["note"] for q in parts if q.get("note")}):
        lines.append(f"  note: {n}")
    for t in sorted({q["timing"] for q in parts if q.get("timing")}):
        lines.append(f"  timed with {t}")
    return "\n".join(lines)


def sandbox_line(av: dict) -> str:
    """Which sandbox `dtlab grade` would put each submission in here (dtlab.course.sandbox), and why not the others."""
    best = next((m for m, why in av.items() if why is None), None)
    others = "; ".join(f"{m}: {why}" for m, why in av.items() if why is not None)
    return (
        "  grading sandbox (dtlab grade --sandbox auto): "
        + (
            best
            or "NONE: dtlab grade refuses to run submissions "
            "unless given --sandbox none; install bubblewrap (apt-get install -y bubblewrap)"
        )
        + (f" (unavailable: {others})" if others else "")
    )


def load_lines(load: dict | None) -> list:
    """The machine's load as `facts` sampled it, and a warning when it is busy: a run made now measures the other
    processes too (its breakdown says so and widens its intervals)."""
    if not load:
        return []

    lines = [f"  {sample_words(load)}"]
    if load.get("busy"):
        lines.append(
            "  warning: this machine is busy: a run started now shares its cores with other processes, so "
            "its step times move with their load (the breakdown says so and widens its intervals). Wait "
            "for the load to go, or compare runs made side by side."
        )
    return lines


def doctor(check_hub: bool = True) -> dict:
    """Print the report and return the facts (for lab 00 and `dtlab doctor`)."""
    f = facts(check_hub=check_hub)
    print(report(f))
    return f


def smoke_allreduce(out: str | None = None, nproc: int = 2, progress: bool = False) -> dict:
    """A real `nproc`-rank all-reduce through the launcher (4 KiB and 1 MiB, a few timed calls each, about
    10 s with start-up): proves that ranks start, find each other and communicate here. Returns the
    placement, the median time per size (seconds) and the wall time of the whole check."""

    from dtlab.launching.calibration import launch_calibration
    from dtlab.results.calibration import samples_frame

    out = out or os.path.join(tempfile.mkdtemp(prefix="dtlab-smoke-"), "allreduce")
    cfg = CalibConfig(
        nproc=nproc, ops=("all_reduce",), sizes=(4096, 1 << 20), warmup=2, iters=5, rounds=1, out=out, timeout_s=120.0
    )
    t0 = time.perf_counter()
    h = launch_calibration(cfg)
    try:
        h.wait(progress=progress)
    except RunFailed:
        if h.status() != "finished":
            raise
        # finished, but a 2-size fit can be refused: the samples are what the smoke test needs
    _, s = samples_frame(out)
    med = s.groupby("nbytes")["seconds"].median()

    return {
        "placement": RunConfig(nproc=nproc).placement().label,
        "wall_s": time.perf_counter() - t0,
        "median_s": {int(k): float(v) for k, v in med.items()},
        "samples": int(len(s)),
        "out": out,
    }


def main(argv: list[str] | None = None) -> int:
    """`dtlab doctor [--json] [--smoke]`."""

    ap = argparse.ArgumentParser(prog="dtlab doctor", description="what this machine can run, and how")
    ap.add_argument("--json", action="store_true", help="print the facts as JSON")
    ap.add_argument("--smoke", action="store_true", help="also run a real 2-rank all-reduce (about 10 s)")
    ap.add_argument("--no-hub", action="store_true", help="do not probe the Hugging Face hub")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        print(json.dumps(probe()))
        return 0
    f = facts(check_hub=not args.no_hub)
    if args.smoke:
        f["smoke_allreduce"] = smoke_allreduce()
    if args.json:
        print(json.dumps(f, indent=2, default=str))
    else:
        print(report(f))
        if args.smoke:
            s = f["smoke_allreduce"]
            sizes = ", ".join(f"{n:,} B: {t * 1e3:.3f} ms" for n, t in s["median_s"].items())
            print(
                f"  smoke test: 2-rank all_reduce on {s['placement']}: {sizes} (median; whole check "
                f"{s['wall_s']:.1f} s)"
            )
    return 0 if "probe_error" not in f and "torch_error" not in f else 1


if __name__ == "__main__":
    sys.exit(main())
