#!/usr/bin/env python3
"""Prepare the NCCL folder the GPU runbook carries (`--nccl .nccl`): libnccl.so.2, checked against its sha256.

    python3 tools/nccl_prepare.py                       # /work/shared/nccl -> .nccl (decompressed and checked)
    python3 tools/nccl_prepare.py --src DIR --dest DIR  # another source or folder
    python3 tools/nccl_prepare.py --xz-only             # carry the .xz (28 MiB) instead: the runbook decompresses it

The source folder holds `libnccl.so.2.xz` and `libnccl.so.2.sha256` (the decompressed library's). The folder made
here holds `libnccl.so.2` (or, with --xz-only, the .xz) and `libnccl.so.2.sha256` beside it; `ready(folder)` (the
runbook's) decompresses a carried .xz where the library is missing and checks the library against the sha256 file
either way. The checkout's .gitignore keeps `.nccl/` out of git. Exit code 0 when the folder is ready.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import sys

LIB = "libnccl.so.2"
SHA = LIB + ".sha256"
XZ = LIB + ".xz"
DEFAULT_SRC = "/work/shared/nccl"
DEFAULT_DEST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".nccl")


def sha256(path: str) -> str:
    """The hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def expected_sha(folder: str) -> str:
    """The sha256 `libnccl.so.2.sha256` in `folder` gives for the library (its first word)."""
    with open(os.path.join(folder, SHA)) as f:
        return f.read().split()[0].lower()


def _decompress(xz: str, dest: str) -> None:
    tmp = dest + ".part"
    with lzma.open(xz) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    os.replace(tmp, dest)


def ready(folder: str) -> dict:
    """{ok, path, sha256, bytes, decompressed, problems}: `folder`'s libnccl.so.2 (decompressed from a carried .xz
    if missing) checked against its sha256 file. Never raises for a missing or wrong file: `problems` says why."""
    folder = os.path.abspath(folder)
    lib, xz = os.path.join(folder, LIB), os.path.join(folder, XZ)
    res = {"ok": False, "path": lib, "folder": folder, "decompressed": False, "problems": []}
    if not os.path.isfile(os.path.join(folder, SHA)):
        res["problems"].append(f"{folder}: no {SHA} (tools/nccl_prepare.py makes the folder)")
        return res
    if not os.path.isfile(lib) and os.path.isfile(xz):
        try:
            _decompress(xz, lib)
            res["decompressed"] = True
        except (OSError, lzma.LZMAError) as e:
            res["problems"].append(f"{xz}: cannot decompress ({e})")
            return res
    if not os.path.isfile(lib):
        res["problems"].append(f"{folder}: neither {LIB} nor {XZ} (tools/nccl_prepare.py makes the folder)")
        return res
    want, got = expected_sha(folder), sha256(lib)
    res.update(sha256=got, bytes=os.path.getsize(lib))
    if got != want:
        res["problems"].append(f"{lib}: sha256 {got}, but {SHA} says {want}")
    res["ok"] = not res["problems"]
    return res


def prepare(src: str, dest: str, xz_only: bool = False) -> dict:
    """Copy the sha256 file into `dest`, and decompress the library there (or copy its .xz, `xz_only`); then
    `ready(dest)` (a .xz is decompressed by the runbook where it runs). A library already there is checked again."""
    os.makedirs(dest, exist_ok=True)
    shutil.copyfile(os.path.join(src, SHA), os.path.join(dest, SHA))
    if xz_only:
        shutil.copyfile(os.path.join(src, XZ), os.path.join(dest, XZ))
        lib = os.path.join(dest, LIB)
        if os.path.exists(lib):
            os.remove(lib)
        return {
            "ok": True,
            "folder": os.path.abspath(dest),
            "carried": XZ,
            "bytes": os.path.getsize(os.path.join(dest, XZ)),
        }
    if not (os.path.isfile(os.path.join(dest, LIB)) and sha256(os.path.join(dest, LIB)) == expected_sha(dest)):
        _decompress(os.path.join(src, XZ), os.path.join(dest, LIB))
    return ready(dest)


def main(argv=None) -> int:
    """`nccl_prepare.py [--src DIR] [--dest DIR] [--xz-only]`: prints the result as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=DEFAULT_SRC, help=f"folder with {XZ} and {SHA} (default {DEFAULT_SRC})")
    ap.add_argument("--dest", default=DEFAULT_DEST, help="the folder to make (default: the checkout's .nccl)")
    ap.add_argument("--xz-only", action="store_true", help=f"copy {XZ}, not the library (the runbook decompresses it)")
    args = ap.parse_args(argv)
    res = prepare(args.src, args.dest, args.xz_only)
    print(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
