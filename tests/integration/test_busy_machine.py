"""A run beside a load that comes and goes: CPU-spinning processes on every core, switched on and off while the
steps run. The breakdown stays consistent (T_comp <= T_step, an overlap in [0, 1]) or says that communication is
below the machine's noise; it never prints a negative exposed time; and the run records how busy the machine was."""

import math
import os
import re
import signal
import subprocess
import sys
import threading

import dtlab


class FlickeringLoad:
    """One CPU-spinning process per core, stopped and continued together (SIGSTOP / SIGCONT) in a seeded random
    rhythm of 50-300 ms on and off, until `stop()`; every spinner is killed by its own pid."""

    def __init__(self, seed: int = 0):
        import random

        self.rng = random.Random(seed)
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._flicker, daemon=True)
        self.thread.start()

    def _signal(self, sig) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, sig)

    def _flicker(self) -> None:
        on = True
        while not self.done.wait(self.rng.uniform(0.05, 0.3)):
            on = not on
            self._signal(signal.SIGCONT if on else signal.SIGSTOP)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self._signal(signal.SIGCONT)
        for p in self.procs:
            p.kill()
            p.wait()


def test_the_breakdown_beside_a_load_that_comes_and_goes_is_consistent_or_says_noise(tmp_path, capsys):
    cfg = dtlab.tiny(out=str(tmp_path / "busy"), steps=30, warmup=2, baseline_steps=10, bucket_mb=0.05)
    load = FlickeringLoad()
    try:
        run = dtlab.run(cfg, progress=False)
    finally:
        load.stop()
    s = run.summary().set_index("quantity")
    for q in ("T_step", "T_comp", "T_comm"):
        assert s.loc[q, "value"] > 0 and s.loc[q, "lo"] <= s.loc[q, "value"] <= s.loc[q, "hi"], q
    exposed, overlap = s.loc["exposed", "value"], s.loc["overlap", "value"]
    assert math.isnan(exposed) or (exposed > 0 and s.loc["exposed", "lo"] > 0)
    assert math.isnan(overlap) or 0 <= overlap <= 1
    if s.loc["T_comp", "value"] > s.loc["T_step", "value"]:
        assert math.isnan(exposed) and "below this machine's noise here: ±" in s.loc["exposed", "how"]
    # the spinners took about one of the cores' worth while the steps ran: recorded, and said
    assert s.loc["machine", "value"] > 0.25 and "machine: busy during the steps" in s.loc["machine", "how"]
    assert "figures widened" in s.loc["machine", "how"]
    from dtlab.cli.main import main

    assert main(["show", run.path]) == 0
    table = capsys.readouterr().out
    for line in table.splitlines():
        if line.strip().startswith(("exposed", "overlap")):
            assert not re.match(r"\s*\w+\s+-\d", line), line
    assert "machine: busy" in table
