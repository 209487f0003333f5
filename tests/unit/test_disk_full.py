"""A full disk, on a small tmpfs (mounted for the test, always unmounted; skipped where mounting is not permitted):
every write in the run directory ends in a RunFailed (or DiskFull) naming the disk and the path, the ranks stop,
status.json says failed, no temporary file is left, and what was recorded still loads."""

import errno
import glob
import json
import os
import subprocess

import pytest

import dtlab
from dtlab.results.events import scan_events
from dtlab.runfiles import DiskFull, dump_json


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


def test_dump_json_on_a_full_disk_leaves_no_temp_file_and_names_the_disk(tmpfs):
    mnt = tmpfs(leave=64 * 1024)
    old = mnt / "status.json"
    dump_json({"state": "running"}, str(old))  # written while there was room: holds one page
    tmpfs(leave=0)
    with pytest.raises(DiskFull) as info:
        dump_json({"state": "finished"}, str(mnt / "new.json"))
    e = info.value
    assert e.errno == errno.ENOSPC and e.path == str(mnt / "new.json")
    assert f"tmpfs at {mnt}" in str(e) and "0 B free of 2 MiB" in str(e) and "new.json" in str(e)
    assert not (mnt / "new.json").exists() and _temp_files(str(mnt)) == []
    # an existing file is rewritten in the space it holds: the end state gets written on a full disk
    dump_json({"state": "failed", "why": "disk full"}, str(old))
    assert json.loads(old.read_text()) == {"state": "failed", "why": "disk full"}
    with pytest.raises(DiskFull):  # more than its page: refused, and the old text is kept whole
        dump_json({"state": "failed", "pad": "x" * 10000}, str(old))
    assert json.loads(old.read_text())["state"] == "failed" and _temp_files(str(mnt)) == []


def test_event_writer_stops_on_a_full_disk_and_stays_stopped(tmpfs):
    from dtlab.rank.recorder import EventWriter

    mnt = tmpfs(leave=8 * 1024)
    w = EventWriter(str(mnt / "events" / "rank0.jsonl"))
    with pytest.raises(DiskFull, match=r"rank0\.jsonl"):
        for step in range(10000):
            w.write("step", rank=0, step=step, t_fwd=0.1, t_bwd=0.1, t_opt=0.1, t_step=0.3, pad="x" * 200)
    with pytest.raises(DiskFull):  # a later write fails too, even after space was freed: the line order is broken
        os.remove(mnt / "filler")
        w.write("done", rank=0)
    w.close()
    scan = scan_events(str(mnt / "events" / "rank0.jsonl"))
    assert scan.damage == [] and len(scan.torn) <= 1 and len(scan.events) == step
    assert [e["step"] for e in scan.events] == list(range(step))


def test_a_launch_on_a_full_disk_starts_nothing(tmpfs, capsys):
    from dtlab.cli.main import main as cli_main

    mnt = tmpfs(leave=0)
    with pytest.raises(dtlab.RunFailed) as info:
        dtlab.launch(dtlab.tiny(out=str(mnt / "run")))
    e = info.value
    assert e.state == "failed" and e.error.startswith("disk full") and f"tmpfs at {mnt}" in str(e)
    assert "config.json" in str(e) and "nothing was started" in str(e)
    assert not (mnt / "run").exists() and _temp_files(str(mnt)) == []
    assert cli_main(["run", "--model", "tiny", "--out", str(mnt / "run"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "dtlab: run failed: disk full: the disk holding" in err and "Traceback" not in err
