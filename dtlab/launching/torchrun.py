"""Starting torchrun and the processes it owns: run directories, the agent shim, finding and signalling PIDs.

- Run directories: `unique_dir` / `default_out` pick a fresh one, `prepare_dir` claims it (mkdir of events/),
  `write_status` writes status.json.
- `start_torchrun`: torchrun's agent in its own session through a shim that dies with the launching process
  (whichever thread started it; `release_lifeline` once it exited) and writes what torchrun knows of each
  failed rank to RUN_DIR/exits.json (and a failed rendezvous to rendezvous.json); c10d rendezvous on
  127.0.0.1 port 0, or one node's part of a multi-node job (dtlab.launching.nodes: per-node file names, the
  shared endpoint, DTLAB_NODE_SLOT in the ranks' environment).
- Processes: the ranks of a run found by their command line through psutil (forked ranks, which carry the agent's,
  by their name too), their kernel state, signals to a PID or a
  process group, and small log readers (`file_size`, `read_from`, `last_lines`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import psutil

from dtlab.config.environment import ENV_SET, LAUNCH_DEFAULTS, set_default
from dtlab.config.ncclib import PRELOADED, preload_env
from dtlab.config.run import RunConfig
from dtlab.launching.agent import RANK_COMM, start_method
from dtlab.launching.warm import enabled as warm_enabled
from dtlab.launching.warm import fork_agent
from dtlab.results.liveness import identity, process_state
from dtlab.runfiles import dump_json

RANK_MODULES = ("dtlab.rank.worker", "dtlab.rank.calibration", "dtlab.rank.harness")


def free_port() -> int:
    """A TCP port free on loopback right now, released at once: racy (another process may take it before it is
    used). dtlab's own launches hold theirs instead (`hold_port`); this is for tests and tools that need a number."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hold_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a port the OS picked on `host`, held until it is closed: its port (`getsockname()[1]`) is
    the rendezvous port of emulated nodes on loopback (dtlab.launching.emulate), which must agree on one before any
    of them binds it. Bound without SO_REUSEADDR, so the OS gives it a port nobody holds, then marked SO_REUSEADDR,
    so that torchrun's TCPStore (which sets it too) can bind and listen on the same port. While it is held the OS
    never hands the port out (another launch's port-0 bind gets another), a bind naming it without SO_REUSEADDR
    fails with EADDRINUSE, and once the store listens every other bind to it fails."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except OSError:
        s.close()
        raise
    return s


def unique_dir(parent: str, name: str) -> str:
    """Create and return parent/name-<timestamp>, with -2, -3, ... when two jobs start within the same
    second. Created with mkdir, which fails when the directory exists, so two launches never share one."""
    os.makedirs(parent, exist_ok=True)
    base = os.path.join(parent, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    k = 1
    while True:
        path = base if k == 1 else f"{base}-{k}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            k += 1


def default_out(cfg: RunConfig) -> str:
    return unique_dir("runs", f"{cfg.strategy}-{cfg.model}-p{cfg.nproc}-b{cfg.ddp.bucket_mb:g}")


def prepare_dir(out: str) -> str:
    """Create the run directory; refuse one that already holds a run. Claimed with mkdir of its events/
    folder, which only one of two simultaneous launches can win."""
    if os.path.exists(os.path.join(out, "config.json")):
        raise ValueError(f"out: {out!r} already holds a run; choose a new directory (runs are never overwritten)")
    os.makedirs(out, exist_ok=True)
    try:
        os.mkdir(os.path.join(out, "events"))
    except FileExistsError:
        raise ValueError(
            f"out: {out!r} already holds a run (or another launch just claimed it); choose a new "
            f"directory (runs are never overwritten)"
        ) from None
    return out


def write_status(run_dir: str, state: str, **fields) -> None:
    """Write status.json. A 'running' status with the agent's `pid` also records who to check later: the agent
    and this launching process, each by pid, start time, host and boot (dtlab.results.liveness)."""
    if state == "running" and isinstance(fields.get("pid"), int):
        fields.setdefault("agent", identity(fields["pid"]))
        fields.setdefault("launcher", identity(os.getpid()))
    dump_json({"state": state, **fields}, os.path.join(run_dir, "status.json"))


# The torchrun agent, started through a shim (dtlab.launching.agent.agent_main) that (1) lives exactly as long as
# the launching *process*: it reads a pipe whose write end only the launcher holds, and end-of-file there (the
# launcher died: a kernel killed outright runs no atexit handler) makes it SIGTERM itself, so torchrun stops its
# ranks (which also die with it), and SIGKILL itself if that takes longer than AGENT_GRACE_S. PR_SET_PDEATHSIG
# cannot do this: it fires when the *thread* that started the agent exits (man 2 prctl), so a launch from a worker
# thread died with that thread. (2) It runs torchrun's main (dtlab.launching.agent: ranks forked from a warm agent
# on gloo, spawned otherwise) and writes what torchrun knows of each failed rank (exit code, signal, pid) to EXITS,
# so RunFailed can name the rank that died without guessing from the order of errors and without parsing
# torchrun's log; a failed rendezvous (a node that never joined, a store nobody hosts) goes to RDZV the same way.
# Both are written atomically; on a full disk they are left out (and no temporary file is left), the launcher says
# why. A single-node CPU job's agent is forked from a warm server with the same arguments (dtlab.launching.warm).
_AGENT = "import sys\nfrom dtlab.launching.agent import agent_main\nagent_main(sys.argv[1:])\n"

# The directory that holds the dtlab package (dtlab/launching/torchrun.py -> three levels up).
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _agent_env(nproc: int, gloo_threads: bool, node) -> dict:
    """The agent's environment: the launcher's, dtlab's launch defaults where unset, a node's own settings, the
    CPU ranks' thread count, for NCCL ranks (`gloo_threads` False) the library DTLAB_NCCL_LIBRARY names preloaded
    (dtlab.config.ncclib.preload_env), and a PYTHONPATH that finds this dtlab."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name, value in LAUNCH_DEFAULTS.items():  # only where unset: the user's NCCL settings win (recorded)
        set_default(env, name, value)
    if node is not None:
        env.update(node.spec.env)
        if node.multi:
            env["DTLAB_NODE_SLOT"] = str(node.slot)  # the ranks record it; the launcher finds its own ranks by it
    if not gloo_threads:  # NCCL ranks: DTLAB_NCCL_LIBRARY first in LD_PRELOAD, which each rank checks
        preload = preload_env(env)
        env.update(preload)
        if preload:  # recorded as dtlab's (resolved.environment)
            env[ENV_SET] = ",".join([n for n in env.get(ENV_SET, "").split(",") if n] + ["LD_PRELOAD", PRELOADED])
    if gloo_threads and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the cores: give each its share instead of torchrun's default of 1 thread.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # The package must be importable by the ranks even when the kernel found it through sys.path alone.
    env["PYTHONPATH"] = os.pathsep.join([_PKG_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def start_torchrun(
    run_dir: str,
    nproc: int,
    module: str,
    gloo_threads: bool,
    node=None,
    is_host: bool | None = None,
    max_restarts: int = 0,
):
    """Start `torchrun -m MODULE RUN_DIR` in its own session, rendezvous on a port the OS picks; or, given
    `node` (a dtlab.launching.nodes.NodeLaunch), this node's agent of a multi-node job (`is_host`: whether it
    hosts the rendezvous store, None: torch decides). With `max_restarts` > 0 torchrun restarts the whole group
    when a rank dies (TORCHELASTIC_RESTART_COUNT counts). `gloo_threads`: the ranks run on CPU with gloo (each
    gets its share of the cores, and they are forked from the warm agent unless DTLAB_START_METHOD=spawn)."""
    method = start_method(gloo_threads)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    env = _agent_env(nproc, gloo_threads, node)
    run_dir = os.path.abspath(run_dir)
    # c10d rendezvous on port 0: the agent's store binds a port the OS picks and the ranks use that store
    # (TORCHELASTIC_USE_AGENT_STORE), so there is no window in which another launch could take the port.
    # (--master-port=0 does not work: the static rendezvous hands the ranks port 0 and they hang.)
    if node is None:
        rdzv = [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            f"--rdzv-id={uuid.uuid4().hex}",
            "--local-addr=127.0.0.1",
        ]
        files = [os.path.join(run_dir, f) for f in ("exits.json", "rendezvous.json", "logs/torchrun.log")]
    else:
        rdzv, files = node.agent_args(is_host), [node.path("exits"), node.path("rendezvous"), node.log_path()]
    prefix = list(node.spec.prefix) if node is not None else []
    life_r, life_w = os.pipe()  # both ends close-on-exec: only the agent is handed the read end (pass_fds)
    args = [
        files[0],
        files[1],
        *rdzv,
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        f"--start-method={method}",
        f"--log-dir={files[2][:-4]}",
        "-m",
        module,
        run_dir,
    ]
    warm = method == "fork" and not prefix and (node is None or not node.multi) and warm_enabled(env)
    try:
        with open(files[2], "ab") as log:
            proc = fork_agent(args, env, life_r, log.fileno()) if warm else None
            if proc is None and warm:  # a fresh lifeline: closing this one stops whatever the server may have forked
                os.close(life_w)
                os.close(life_r)
                life_r, life_w = os.pipe()
            if proc is None:
                proc = subprocess.Popen(
                    prefix + [sys.executable, "-c", _AGENT, str(life_r), *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    pass_fds=(life_r,),
                )
    except BaseException:
        os.close(life_w)
        raise
    finally:
        os.close(life_r)
    proc.dtlab_lifeline = life_w  # held open while the agent runs: see release_lifeline
    return proc


def release_lifeline(proc: subprocess.Popen) -> None:
    """Close the launcher's end of an agent's lifeline once the agent has exited (closing it earlier would stop
    the agent, which is what the launcher's death does)."""
    fd = getattr(proc, "dtlab_lifeline", None)
    if fd is not None and proc.poll() is not None:
        proc.dtlab_lifeline = None
        os.close(fd)


def check_omp_threads(environ=os.environ) -> None:
    """OMP_NUM_THREADS, when set, must be a positive whole number (threads per rank; torch ignores 0 and uses
    every core instead). ValueError naming it otherwise, before anything starts."""
    v = environ.get("OMP_NUM_THREADS")
    if v is not None and not (v.strip().isdigit() and int(v) > 0):
        raise ValueError(
            f"OMP_NUM_THREADS must be a whole number >= 1 (threads per rank), got {v!r} in the "
            "environment; unset it to let dtlab give each CPU rank its share of the cores "
            f"({os.cpu_count() or 1} cores / ranks)"
        )


# ---- processes --------------------------------------------------------------------------------------------
def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except (psutil.Error, ValueError):
        return None


def _argv(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()  # a warm agent's is NUL-padded (dtlab.launching.warm): empty strings at its end
    except (psutil.Error, OSError):
        return []  # gone, a zombie, or not ours to read


def _is_rank(p: psutil.Process, run_dir: str, slot: int | None) -> bool:
    argv = _argv(p)  # a zombie has no command line: dead for our purposes
    ok = os.path.abspath(run_dir) in argv and any(m in argv for m in RANK_MODULES) and p.pid != os.getpid()
    try:
        if ok and argv[1:2] == ["-c"]:  # torchrun's agent (our shim), or a rank forked from it (same command line)
            ok = p.name() == RANK_COMM
        if ok and slot is not None:
            ok = p.environ().get("DTLAB_NODE_SLOT") == str(slot)
    except (psutil.Error, OSError):
        ok = False
    return ok


def is_rank_of(pid: int, run_dir: str, slot: int | None = None) -> bool:
    """True if `pid` is alive and is a rank started for `run_dir`: its arguments include the run directory
    itself (not merely a path that starts with it) and a dtlab rank module; a rank forked from torchrun's agent
    carries the agent's command line and is told from the agent by its name (RANK_COMM). Never a reused PID. With
    `slot`, only a rank of that node of a multi-node job (two emulated nodes share one machine's process table)."""
    p = _process(pid)
    return p is not None and _is_rank(p, run_dir, slot)


def rank_processes(run_dir: str, slot: int | None = None) -> list[psutil.Process]:
    """Every live rank process of `run_dir` (of node `slot` only, when given), as psutil processes: each holds its
    pid and start time, so a signal sent through it never reaches a process that reused the pid."""
    return [p for p in psutil.process_iter() if _is_rank(p, run_dir, slot)]


_STATES = {
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X",
    psutil.STATUS_IDLE: "I",
}


def proc_state(pid: int | None) -> str | None:
    """The kernel's one-letter state of a process (R, S, D, T stopped, Z zombie, ...), None if gone."""
    state = process_state(pid)
    return None if state is None else _STATES.get(state, state[:1].upper())


def kill_pid(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_process(p: psutil.Process, sig: int) -> None:
    """Send `sig` to `p` unless it has gone (psutil checks its start time first: a reused pid is left alone)."""
    try:
        p.send_signal(sig)
    except (psutil.Error, PermissionError):
        pass


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(os.getpgid(pid), sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---- logs -------------------------------------------------------------------------------------------------
def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def last_lines(path: str, n: int = 12) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "\n".join(f.read().strip().splitlines()[-n:])
