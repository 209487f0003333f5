"""A full disk, on a small tmpfs (mounted for the test, always unmounted; skipped where mounting is not permitted):
every write in the run directory ends in a RunFailed (or DiskFull) naming the disk and the path, the ranks stop,
status.json says failed, no temporary file is left, and what was recorded still loads."""

import errno
import glob
import json
import os
import subprocess
import warnings

import pytest

import dtlab
from dtlab.results.events import scan_events
from dtlab.results.run import load_run


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB tmpfs at tmp_path/fs: yields a function that fills it, leaving `leave` bytes free."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    cp = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if cp.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {cp.stderr.strip()}")

    def fill(leave=0):
        st = os.statvfs(mnt)
        free = st.f_bfree * st.f_frsize
        with open(mnt / "filler", "wb") as f:
            f.write(b"\0" * max(0, free - leave))
        if leave == 0:  # the last partial page
            try:
                with open(mnt / "filler2", "wb") as f:
                    while True:
                        f.write(b"\0" * 512)
                        f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
        return mnt

    try:
        yield fill
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _temp_files(root):
    return [p for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if ".tmp" in os.path.basename(p)]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_run_that_fills_the_disk_fails_naming_it(tmpfs, capsys):
    mnt = tmpfs(leave=128 * 1024)  # about 120 steps of the tiny model's records
    out = mnt / "run"
    with pytest.raises(dtlab.RunFailed) as info:
        dtlab.run(dtlab.tiny(out=str(out), steps=100000, timeout_s=300), progress=False)
    e = info.value
    assert e.state == "failed" and e.error.startswith(f"disk full: the disk holding {out} is full: tmpfs at {mnt}")
    assert "every rank was stopped" in str(e)
    pids = [
        ev["pid"]
        for r in (0, 1)
        for ev in scan_events(str(out / "events" / f"rank{r}.jsonl")).events
        if ev["kind"] == "start"
    ]
    assert len(pids) == 2 and not [p for p in pids if _alive(p)]
    status = json.loads((out / "status.json").read_text())  # written in place on the full disk
    assert status["state"] == "failed" and "tmpfs at" in status["disk"]
    assert _temp_files(str(mnt)) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only torn last lines: tolerated, no warning
        run = load_run(str(out))
    assert run.status["state"] == "failed" and len(run.steps) > 20 and run.damage["tolerated"].all()
    from dtlab.cli.main import main as cli_main

    assert cli_main(["show", str(out)]) == 1
    assert "status: failed: the disk holding" in capsys.readouterr().out
