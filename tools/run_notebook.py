#!/usr/bin/env python3
"""Execute a lab notebook headless in a working folder (its runs/ and profiles/ land there); exit 1 on an error.

    python3 tools/run_notebook.py labs/04_zero3_vs_ddp.ipynb WORKDIR [--timeout 300] [--save EXECUTED.ipynb]

Prints what the cells printed and, if a cell raised, its error. Used by tools/gpu_runbook.py (set
DTLAB_QUICK=1 for quick mode).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebook")
    ap.add_argument("workdir")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per cell")
    ap.add_argument("--save", default=None, help="write the executed notebook (its outputs, claims and errors) here")
    args = ap.parse_args(argv)
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(
        nb, timeout=args.timeout, kernel_name="python3", resources={"metadata": {"path": args.workdir}}
    )
    try:
        client.execute()
        failed = None
    except CellExecutionError as e:
        failed = str(e)
    if args.save:
        nbformat.write(nb, args.save)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                sys.stdout.write(o.get("text", ""))
    if failed:
        print(f"\nnotebook failed:\n{failed[-3000:]}")
        return 1
    print(f"\nnotebook ran: {sum(c.cell_type == 'code' for c in nb.cells)} code cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
