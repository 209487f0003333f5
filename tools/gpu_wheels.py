"""The wheel folder a bare GPU machine installs dtlab's missing packages from, and the checks around it.

- `check_wheels(folder)`: before anything is installed (any machine): every wheel of tools/gpu-wheels.txt is in
  the folder, once, for CPython 3.12 x86-64 Linux; no wheel would shadow the machine's torch stack (torch,
  triton, nvidia-*); every requirement of every wheel is met by another wheel of the folder at a version its
  specifier allows, or by a package the GPU image has (tools/gpu-device-packages.txt: names only, so those
  versions are checked on the machine, by `check_installed`); the folder is under WHEELS_MAX_BYTES.
- `check_installed(site)`: on the machine, after `pip install --no-index --no-deps --target SITE`: every
  requirement of every installed distribution met by what Python sees with SITE first on its path, at an allowed
  version, and torch still the machine's own. Runs in a child Python (prints JSON).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser

HERE = os.path.dirname(os.path.abspath(__file__))
PY_VERSION = "3.12"  # the GPU machines' python3
#: The folder travels with the working tree, at most 64 MiB in all (TREE_MAX_BYTES); the tree is about 1.3 MB.
WHEELS_MAX_BYTES = 40 * 2**20
TREE_MAX_BYTES = 64 * 2**20
#: Never carried: installing any of these into the target folder would shadow the machine's CUDA build of torch.
TORCH_STACK = re.compile(r"^(torch|triton|nvidia-.*)$")


def norm(name: str) -> str:
    """A distribution name in PEP 503 normal form."""
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: str) -> list[str]:
    """The non-comment, non-empty lines of a list file."""
    with open(path) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def _linux_env() -> dict:
    from packaging.markers import default_environment

    return dict(
        default_environment(),
        python_version=PY_VERSION,
        python_full_version=f"{PY_VERSION}.3",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        extra="",
    )


def _requires(path: str) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(meta).decode("utf-8", "replace")).get_all("Requires-Dist") or []


def _tag_problems(fn: str, parts: list[str]) -> list[str]:
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    out = []
    abi3_ok = abi == "abi3" and all(t.startswith("cp3") and int(t[3:] or 0) <= 12 for t in py.split("."))
    if not (py in ("py3", "py2.py3") or "cp312" in py or abi3_ok):
        out.append(f"{fn}: built for {py}, the GPU machine runs CPython {PY_VERSION}")
    if not (plat == "any" or ("x86_64" in plat and "linux" in plat)):
        out.append(f"{fn}: platform {plat} is not x86-64 Linux")
    if abi not in ("none", "abi3") and "cp312" not in abi:
        out.append(f"{fn}: ABI {abi} does not match CPython {PY_VERSION}")
    return out


def check_wheels(folder: str, wanted_file: str | None = None, device_file: str | None = None) -> dict:
    """{ok, problems, wheels, bytes}: the folder checked against the wheel list and the device's packages."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    wanted = {}
    for line in listed(wanted_file or os.path.join(HERE, "gpu-wheels.txt")):
        name, _, version = line.partition("==")
        wanted[norm(name)] = version
    device_has = {norm(n) for n in listed(device_file or os.path.join(HERE, "gpu-device-packages.txt"))}
    if not os.path.isdir(folder):
        return {
            "ok": False,
            "problems": [
                f"wheel folder {folder!r} does not exist: build it with "
                "tools/make_gpu_wheels.sh on a machine that reaches PyPI"
            ],
            "wheels": 0,
        }
    problems, found = [], {}
    for fn in sorted(f for f in os.listdir(folder) if f.endswith(".whl")):
        parts = fn[:-4].split("-")
        name, version = norm(parts[0]), parts[1]
        if name in found:
            problems.append(f"{name}: two wheels ({found[name]['file']}, {fn}); keep one version")
        if TORCH_STACK.match(name):
            problems.append(f"{fn}: would shadow the machine's torch stack (torch, triton, nvidia-*): never carried")
        found[name] = {"file": fn, "version": version}
        problems += _tag_problems(fn, parts)
    for name, version in wanted.items():
        if name not in found:
            problems.append(f"{name}=={version}: missing")
        elif found[name]["version"] != version:
            problems.append(f"{name}: wheel is {found[name]['version']}, gpu-wheels.txt pins {version}")
    env, unmet = _linux_env(), set()
    for name, info in found.items():
        for r in _requires(os.path.join(folder, info["file"])):
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = norm(req.name)
            if dep in found:
                try:
                    ok = req.specifier.contains(Version(found[dep]["version"]), prereleases=True)
                except InvalidVersion:
                    ok = False
                if not ok:
                    unmet.add(f"{dep}{req.specifier} (needed by {name}; the folder has {found[dep]['version']})")
            elif dep != "torch" and dep not in device_has:
                unmet.add(f"{dep} (needed by {name})")
    problems += [f"requirement not met by the folder or the machine: {u}" for u in sorted(unmet)]
    size = sum(os.path.getsize(os.path.join(folder, i["file"])) for i in found.values())
    if size > WHEELS_MAX_BYTES:
        problems.append(
            f"the folder holds {size / 2**20:.1f} MiB of wheels, more than {WHEELS_MAX_BYTES / 2**20:.0f} "
            f"MiB (it travels with the working tree, {TREE_MAX_BYTES / 2**20:.0f} MiB in all)"
        )
    return {"ok": not problems, "problems": problems, "wheels": len(found), "bytes": size}


_INSTALLED_CHECK = r"""
import json, sys
from importlib import metadata
from packaging.markers import default_environment
from packaging.requirements import Requirement
site = sys.argv[1]
env = dict(default_environment(), extra="")
unmet, seen = [], []
for dist in metadata.distributions(path=[site]):
    seen.append(dist.metadata["Name"])
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        try:
            v = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{req.name} (needed by {dist.metadata['Name']}): not installed")
            continue
        if not req.specifier.contains(v, prereleases=True):
            unmet.append(f"{req.name}{req.specifier} (needed by {dist.metadata['Name']}): found {v}")
torch_file = None
try:
    import torch
    torch_file, torch_version = torch.__file__, torch.__version__
except Exception as e:
    torch_version = f"not importable: {e}"
print(json.dumps({"unmet": sorted(set(unmet)), "installed": len(seen), "torch": torch_version,
                  "torch_from_site": bool(torch_file and torch_file.startswith(site))}))
"""


def check_installed(site: str, timeout_s: float = 120.0) -> dict:
    """{ok, unmet, installed, torch, torch_from_site}, asked of a child Python whose path starts with `site`."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
        ),
    )
    cp = subprocess.run(
        [sys.executable, "-c", _INSTALLED_CHECK, site],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    lines = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
    if cp.returncode != 0 or not lines:
        return {"ok": False, "unmet": [f"the check did not run: {(cp.stderr or cp.stdout)[-800:]}"]}
    res = json.loads(lines[-1])
    res["ok"] = not res["unmet"] and not res["torch_from_site"] and not res["torch"].startswith("not importable")
    return res


def tree_bytes(root: str, skip: tuple = (".git", ".whl")) -> int:
    """Bytes of the working tree under `root` that travels to a device besides carried folders: the files git
    tracks, or (no git there) every file outside `skip` and caches."""
    try:
        cp = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, timeout=60)
        names = [n for n in cp.stdout.decode().split("\0") if n] if cp.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        names = None
    if names is None:
        names = []
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if x not in skip and x != "__pycache__"]
            names += [os.path.relpath(os.path.join(d, f), root) for f in files]
    return sum(os.path.getsize(os.path.join(root, n)) for n in names if os.path.isfile(os.path.join(root, n)))
