"""The ranks' NCCL library, proved with tiny fake libnccl files compiled here (dtlab.config.ncclib): versions read
through ctypes' ncclGetVersion, DTLAB_NCCL_LIBRARY checked, placement by the library when torch's header is older,
LD_PRELOAD reaching NCCL ranks (child processes), a rank that loaded another library stopping before any step, the
doctor's lines. The rules that need no library are tested in tests/unit/test_ncclib.py."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from dtlab.cli import doctor
from dtlab.config import ncclib, placement
from dtlab.config.environment import ENV_SET, env_record
from dtlab.config.ncclib import ENV, PRELOADED
from dtlab.config.run import RunConfig
from dtlab.launching import torchrun

CC = shutil.which("cc") or shutil.which("gcc")


def _compile(folder, code: int, body: str | None = None, soname: str = "libnccl.so.2"):
    """A shared library named libnccl.so.2 (its soname too, unless given) in `folder` whose ncclGetVersion says
    `code`."""
    if CC is None:
        pytest.skip("no C compiler (cc or gcc) to build a fake libnccl")
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "nccl.c"
    src.write_text(body or f"int ncclGetVersion(int *v){{*v={code};return 0;}}\n")
    lib = folder / "libnccl.so.2"
    subprocess.run([CC, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(lib), str(src)], check=True)
    return str(lib)


@pytest.fixture
def libs(tmp_path):
    """Fake libraries: NCCL 2.30.7 (the one carried), 2.28.9 (torch 2.11's), 2.8.4 (the old code scheme), and a
    shared library without ncclGetVersion. Each in a folder of its own (a path is loaded once per process)."""
    return {
        "new": _compile(tmp_path / "new", 23007),
        "torch": _compile(tmp_path / "torch", 22809),
        "old": _compile(tmp_path / "old", 2804),
        "other": _compile(tmp_path / "other", 0, "int somethingElse(void){return 1;}\n"),
    }


@pytest.fixture
def clean_env(monkeypatch):
    for name in (ENV, PRELOADED, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_version_codes_decode_in_both_schemes(libs):
    assert ncclib.decode(23007) == (2, 30, 7) and ncclib.decode(22809) == (2, 28, 9)
    assert ncclib.decode(21003) == (2, 10, 3) and ncclib.decode(20906) == (2, 9, 6)  # from 2.9: major*10000
    assert ncclib.decode(2804) == (2, 8, 4)  # before 2.9: major*1000 + minor*100 + patch
    assert ncclib.library_version(libs["new"]) == (2, 30, 7)
    assert ncclib.library_version(libs["torch"]) == (2, 28, 9)
    assert ncclib.library_version(libs["old"]) == (2, 8, 4)


def test_a_file_that_is_not_nccl_is_refused_by_name(libs, tmp_path):
    with pytest.raises(ValueError, match="no ncclGetVersion: not an NCCL library"):
        ncclib.library_code(libs["other"])
    with pytest.raises(ValueError, match="no such file"):
        ncclib.library_code(str(tmp_path / "missing.so"))
    text = tmp_path / "libnccl.txt"
    text.write_text("not a library")
    with pytest.raises(ValueError, match="cannot be loaded as a shared library"):
        ncclib.library_code(str(text))


@pytest.mark.parametrize("what", ["missing", "other", "text"])
def test_a_bad_dtlab_nccl_library_is_refused_naming_the_variable(libs, tmp_path, what):
    path = {"missing": str(tmp_path / "nope" / "libnccl.so.2"), "other": libs["other"], "text": __file__}[what]
    for call in (ncclib.requested_library, ncclib.ranks_library, ncclib.preload_env):
        with pytest.raises(ValueError, match=f"{ENV} must be the path of an NCCL library file") as e:
            call({ENV: path})
        assert repr(path) in str(e.value)


def test_a_path_ld_preload_would_split_is_refused(libs, tmp_path):
    """ctypes loads "/a b/libnccl.so.2", but LD_PRELOAD splits it at the space and the ranks would load torch's own."""
    spaced = tmp_path / "a b"
    spaced.mkdir()
    shutil.copy(libs["new"], spaced / "libnccl.so.2")
    with pytest.raises(ValueError, match="without spaces or colons"):
        ncclib.preload_env({ENV: str(spaced / "libnccl.so.2")})


def test_where_the_ranks_library_comes_from(libs, clean_env):
    assert ncclib.requested_library({}) is None and ncclib.requested_library({ENV: "  "}) is None
    asked = ncclib.ranks_library({ENV: libs["new"], "LD_PRELOAD": libs["torch"]})  # the variable wins
    assert (asked.path, asked.text, asked.source) == (libs["new"], "2.30.7", ENV)
    pre = ncclib.ranks_library({"LD_PRELOAD": f"/usr/lib/libfoo.so {libs['other']}:{libs['torch']}"})
    assert (pre.path, pre.code, pre.source) == (libs["torch"], 22809, "LD_PRELOAD")
    # nothing asked for: the library this process loaded (torch's own on a CUDA build, none on a CPU one), and a
    # file read for its version is never taken for it
    own = ncclib.loaded_library()
    assert ncclib.ranks_library({}) == own and (own is None or own.path not in libs.values())
    assert asked.to_dict() == {
        "path": libs["new"],
        "version": "2.30.7",
        "code": 23007,
        "source": ENV,
        "from": f"named by {ENV}",
    }


def _one_gpu(monkeypatch, header="2.28.9"):
    """A machine with one GPU whose torch was compiled against NCCL `header` (no GPU needed)."""
    monkeypatch.setattr(placement, "device_count", lambda: 1)
    monkeypatch.setattr(placement, "torch_nccl_header", lambda: header)


def test_a_library_newer_than_torchs_header_places_ranks_on_a_shared_gpu(libs, clean_env):
    _one_gpu(clean_env)
    clean_env.setenv(ENV, libs["new"])
    assert placement.machine_gpus() == (1, "2.30.7")
    p = RunConfig(nproc=2).placement()
    assert (p.backend, p.gpus, p.ranks_per_gpu) == ("nccl", 1, 2) and "NCCL 2.30.7" in p.label
    assert p.env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    clean_env.setenv(ENV, libs["torch"])  # the library decides, not the header: 2.28.9 cannot share the GPU
    assert RunConfig(nproc=2).placement().backend == "gloo"


def test_nccl_ranks_get_the_library_preloaded(libs, clean_env):
    clean_env.setenv(ENV, libs["new"])
    clean_env.setenv("LD_PRELOAD", "/usr/lib/libother.so")
    env = torchrun._agent_env(2, False, None)  # NCCL ranks
    assert env["LD_PRELOAD"] == f"{libs['new']}:/usr/lib/libother.so" and env[PRELOADED] == libs["new"]
    assert {"LD_PRELOAD", PRELOADED} <= set(env[ENV_SET].split(","))
    assert env_record(env)["set_by_dtlab"]["LD_PRELOAD"] == env["LD_PRELOAD"]  # recorded as dtlab's
    gloo = torchrun._agent_env(2, True, None)  # gloo ranks load no NCCL: nothing preloaded
    assert gloo["LD_PRELOAD"] == "/usr/lib/libother.so" and PRELOADED not in gloo
    clean_env.setenv(ENV, libs["other"])
    with pytest.raises(ValueError, match=ENV):
        torchrun._agent_env(2, False, None)


_CHILD = (
    "import ctypes, json\n"
    "from dtlab.config import ncclib\n"
    "v = ctypes.c_int()\n"
    "ctypes.CDLL('libnccl.so.2').ncclGetVersion(ctypes.byref(v))\n"
    "asked = ncclib.requested_library()\n"
    "loaded = ncclib.loaded_library()\n"
    "print(json.dumps({'soname': v.value, 'asked': asked and asked.code, 'loaded': loaded.to_dict()}))\n"
)


def _child(env: dict, code: str = _CHILD):
    cp = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return cp


def test_the_library_the_process_loaded_is_found_every_time(libs, clean_env):
    """A libnccl the process mapped itself (as torch does on import) is its library at every ask: reading its
    version must not mark it as one this module opened only to read a version."""
    code = (
        "import ctypes, json, sys\nfrom dtlab.config import ncclib\nctypes.CDLL(sys.argv[1])\n"
        "print(json.dumps([ncclib.loaded_library().to_dict(), ncclib.loaded_library().to_dict()]))"
    )
    cp = subprocess.run([sys.executable, "-c", code, libs["torch"]], capture_output=True, text=True, timeout=60)
    first, second = json.loads(cp.stdout)
    assert first == second and first["path"] == libs["torch"] and first["code"] == 22809, cp.stderr


def test_a_child_with_ld_preload_reports_the_preloaded_version(libs, clean_env):
    """ctypes in a child process started with LD_PRELOAD: loading libnccl.so.2 by name gives the preloaded library,
    and dtlab's `loaded_library` names that file, even after the library DTLAB_NCCL_LIBRARY names (another file)
    was loaded by path to read its version."""
    env = dict(os.environ, LD_PRELOAD=libs["new"])
    out = json.loads(_child(env).stdout)
    assert out["soname"] == 23007 and out["loaded"]["code"] == 23007 and out["loaded"]["path"] == libs["new"]
    out = json.loads(_child(dict(os.environ, LD_PRELOAD=libs["torch"], **{ENV: libs["new"]})).stdout)
    assert (out["soname"], out["asked"], out["loaded"]["code"]) == (22809, 23007, 22809)
    assert out["loaded"]["path"] == libs["torch"]


def _rank(run_dir, env):
    """One training rank (`python -m dtlab.rank.worker RUN_DIR`) as torchrun would start it, in `env`."""
    (run_dir / "events").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"config": RunConfig(model="tiny").to_dict()}))
    env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    cp = subprocess.run(
        [sys.executable, "-m", "dtlab.rank.worker", str(run_dir)], env=env, capture_output=True, timeout=120
    )
    events = [json.loads(line) for line in (run_dir / "events" / "rank0.jsonl").read_text().splitlines()]
    return cp.returncode, events, (run_dir / "logs" / "rank0.log").read_text()


def test_a_rank_that_loaded_another_library_stops_before_any_step(libs, clean_env, tmp_path):
    """The launcher's environment for NCCL ranks, with the preloaded file then swapped for torch's 2.28.9 (a loader
    that did not take the asked-for library): the rank stops with an error naming both, before any step."""
    clean_env.setenv(ENV, libs["new"])
    env = torchrun._agent_env(1, False, None)
    # another soname than NCCL's: on a CUDA build of torch the real libnccl must still load for torch's other calls
    swap = _compile(tmp_path / "swap", 22809, soname="libnccl-swapped.so.2")
    rc, events, log = _rank(tmp_path / "swapped", dict(env, LD_PRELOAD=swap))
    kinds = [e["kind"] for e in events]
    assert rc != 0 and kinds == ["start", "error"], (kinds, log[-2000:])
    err = events[-1]["error"]
    assert err.startswith("RuntimeError") and "asked for" in err and libs["new"] in err and "2.28.9" in err
    assert "stops before its first step" in err


def test_a_rank_with_the_asked_for_library_passes_the_check(libs, clean_env):
    clean_env.setenv(ENV, libs["new"])
    env = torchrun._agent_env(1, False, None)
    code = "from dtlab.config.ncclib import check_preloaded\nprint(check_preloaded().to_dict()['version'])"
    cp = _child(env, code)
    assert cp.returncode == 0 and cp.stdout.strip() == "2.30.7", cp.stderr
    cp = _child(dict(env, LD_PRELOAD=""), code)  # asked for, not loaded at all
    assert cp.returncode != 0 and "no NCCL library is loaded" in cp.stderr


BASE = {
    "python": "3.12.3",
    "torch": "2.11.0+cu130",
    "cuda_build": "13.0",
    "cpu_cores": 16,
    "gpus": [{"name": "NVIDIA H200", "memory_gib": 139.8}],
    "labs": {},
}


def test_the_doctor_reads_the_library_and_the_header(libs, clean_env):
    clean_env.setattr(doctor, "torch_nccl_header", lambda: "2.28.9")
    clean_env.setenv(ENV, libs["new"])
    f = {**BASE, **doctor.nccl_facts(cuda=True)}
    assert f["nccl"] == "2.30.7" and f["nccl_header"] == "2.28.9" and f["nccl_library"]["path"] == libs["new"]
    text = doctor.report(f)
    assert f"NCCL library {libs['new']}: 2.30.7 (ncclGetVersion); torch's header: 2.28.9" in text
    assert "warning: the ranks' NCCL library (2.30.7) is not the NCCL torch was compiled with (2.28.9)" in text
    assert "two ranks per GPU allowed" in text and "pip install" not in text
    clean_env.setenv(ENV, libs["other"])
    f = {**BASE, **doctor.nccl_facts(cuda=True)}
    assert f["nccl"] == "2.28.9" and ENV in f["nccl_library_error"]
    assert f"NCCL library refused: {ENV} must be" in doctor.report(f)
    assert doctor.nccl_facts(cuda=False)["nccl"] is None  # no CUDA: nothing placed by NCCL
