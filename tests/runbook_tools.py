"""The GPU runbook's tools (tools/gpu_runbook.py, tools/gpu_wheels.py) loaded as modules, and a stand-in wheel folder:
shared by the runbook's tests of every tier."""

import importlib.util
import pathlib
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sys.path = [p for p in sys.path if p not in (str(ROOT), str(TOOLS))]
runbook = _load("gpu_runbook")  # puts the checkout and tools/ on sys.path itself, before any step
wheels = _load("gpu_wheels")


def _wheel(folder, name, version, requires=(), tag="py3-none-any"):
    fn = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    with zipfile.ZipFile(fn, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return fn


def _fake_folder(tmp_path):
    """Every listed wheel, with requirements only on each other and on what the GPU machine has."""
    folder = tmp_path / "whl"
    folder.mkdir()
    for line in wheels.listed(str(TOOLS / "gpu-wheels.txt")):
        name, _, version = line.partition("==")
        reqs = ["torch", "numpy>=1.24", "hjson"] if name == "deepspeed" else []
        reqs += ["typing-extensions>=4.14.1"] if name == "pydantic" else []
        reqs += ['pywin32; sys_platform == "win32"']  # a marker that does not apply on Linux
        _wheel(folder, name, version, reqs)
    return folder
