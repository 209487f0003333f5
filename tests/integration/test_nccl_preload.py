"""DTLAB_NCCL_LIBRARY through a real torchrun: the launcher's environment for NCCL ranks (here on CPU, where the
ranks then train on gloo) preloads the library into both ranks, each rank proves it loaded that file before its
first step, and the run records what dtlab set."""

import json
import shutil
import subprocess
import time

import pytest

from dtlab.config.ncclib import ENV, PRELOADED
from dtlab.config.run import RunConfig
from dtlab.launching.nodes import start_job
from dtlab.launching.torchrun import release_lifeline


def test_both_ranks_load_the_library_the_launcher_preloads(tmp_path, monkeypatch):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) to build a fake libnccl")
    (tmp_path / "nccl.c").write_text("int ncclGetVersion(int *v){*v=23007;return 0;}\n")
    lib = str(tmp_path / "libnccl.so.2")
    subprocess.run([cc, "-shared", "-fPIC", "-o", lib, str(tmp_path / "nccl.c")], check=True)
    monkeypatch.setenv(ENV, lib)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    out = str(tmp_path / "run")
    cfg = RunConfig(model="tiny", steps=2, warmup=0, batch_size=4, seq_len=16, baseline_steps=0, out=out).validate()
    # gloo_threads=False: the environment NCCL ranks get (the ranks themselves find no GPU and use gloo on CPU)
    _, proc = start_job(cfg, "config", cfg.to_dict(), {"time": time.time()}, "dtlab.rank.worker", False)
    try:
        assert proc.wait(timeout=240) == 0, open(f"{out}/logs/torchrun.log").read()[-3000:]
    finally:
        release_lifeline(proc)
    for r in (0, 1):
        log = open(f"{out}/logs/rank{r}.log").read()
        assert f"rank {r}: NCCL library {lib}: 2.30.7 (ncclGetVersion 23007), preloaded" in log
    env = json.load(open(f"{out}/config.json"))["resolved"]["environment"]["set_by_dtlab"]
    assert env["LD_PRELOAD"] == lib and env[PRELOADED] == lib
