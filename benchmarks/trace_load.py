"""dtlab.load_trace beside Holistic Trace Analysis on the same Kineto traces: wall time to load and compute the
comm/comp overlap, the child process's peak resident memory, and the two overlap figures.

    python benchmarks/trace_load.py                       # the two public traces shipped with dtlab
    python benchmarks/trace_load.py --hta-python PYTHON   # HTA installed in another environment
    python benchmarks/trace_load.py --big-mb 1000         # also a synthetic folder of that size, dtlab only

HTA (pip holistictraceanalysis) is an optional dependency of this benchmark only. Each measurement runs in a fresh
process (peak memory from getrusage of that child). Figures: docs/benchmarks.md and docs/traces.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile

DTLAB = """
import json, resource, sys, time
t = time.perf_counter()
from dtlab.results.kineto import load_trace
tr = load_trace(sys.argv[1]); ov = tr.overlap(); b = tr.breakdown()
print(json.dumps({"s": time.perf_counter() - t, "overlap": [float(x) for x in ov["overlap_pct"]], "steps": len(b),
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""
HTA = """
import json, logging, resource, sys, time
logging.disable(logging.WARNING)
t = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1]); df = a.get_comm_comp_overlap(visualize=False)
print(json.dumps({"s": time.perf_counter() - t, "overlap": [float(x) for x in df["comp_comm_overlap_pctg"]],
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _run(python: str, code: str, path: str) -> dict:
    cp = subprocess.run([python, "-c", code, path], capture_output=True, text=True, check=False, timeout=3600)
    if cp.returncode:
        return {"error": (cp.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(cp.stdout.strip().splitlines()[-1])


def _json_mb(path: str) -> float:
    """Uncompressed size of a trace file or folder (MB)."""
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    total = 0
    for f in files:
        with gzip.open(f, "rb") if f.endswith(".gz") else open(f, "rb") as h:
            while chunk := h.read(1 << 24):
                total += len(chunk)
    return total / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hta-python", default=sys.executable, help="a Python with holistictraceanalysis installed")
    ap.add_argument("--big-mb", type=float, default=0, help="also load a synthetic folder of about this many MB")
    args = ap.parse_args()
    from dtlab.results.kineto import public_trace

    cases = [(name, public_trace(name)) for name in ("hta-2ranks-rank0", "hta-8ranks-rank3")]
    print(
        f"{'trace':<18} {'JSON MB':>8} {'dtlab s':>8} {'HTA s':>7} {'speed-up':>8} {'dtlab peak MB':>13} "
        f"{'HTA peak MB':>11} {'overlap dtlab %':>15} {'overlap HTA %':>13}"
    )
    for name, path in cases:
        folder = tempfile.mkdtemp()  # HTA reads folders
        shutil.copy(path, folder)
        mb = _json_mb(path)
        d, h = _run(sys.executable, DTLAB, folder), _run(args.hta_python, HTA, folder)
        speed = h["s"] / d["s"] if "s" in h and "s" in d else float("nan")
        print(
            f"{name:<18} {mb:8.1f} {d.get('s', float('nan')):8.2f} {h.get('s', float('nan')):7.2f} {speed:7.1f}x "
            f"{d.get('peak_mb', 0):13.0f} {h.get('peak_mb', 0):11.0f} {d.get('overlap', ['?'])[0]:>15} "
            f"{h.get('overlap', ['?'])[0] if 'overlap' in h else h.get('error', '?'):>13}"
        )
        shutil.rmtree(folder)
    if args.big_mb:
        from dtlab.results.kineto.synthetic import write_synthetic

        folder = tempfile.mkdtemp()
        steps = max(1, int(args.big_mb / 8 / 2 / 0.0016))  # about 1.6 kB per step per rank with the padding below
        write_synthetic(folder, nproc=8, steps=steps // 8, sizes=tuple(1 << k for k in range(16, 26)), pad="x" * 600)
        mb = _json_mb(folder)
        base = _run(
            sys.executable,
            "import resource,dtlab.results.kineto,pandas,numpy;"
            "print('{\"peak_mb\": %f}' % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024))",
            folder,
        )
        d = _run(sys.executable, DTLAB, folder)
        print(
            f"synthetic folder, 8 ranks: {mb:.0f} MB of JSON: dtlab {d.get('s', float('nan')):.1f} s, peak "
            f"{d.get('peak_mb', 0):.0f} MB ({base['peak_mb']:.0f} MB of it the interpreter and its imports), "
            f"{d.get('steps')} rank-steps"
        )
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
