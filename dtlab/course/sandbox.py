"""The sandbox each submission is graded in (`dtlab grade --sandbox auto|bwrap|namespaces|none`).

`dtlab grade` executes every notebook again, so it runs code written by whoever submitted it. Each notebook's
grader (`python -m dtlab.course.grader`, with the notebook's kernel and every process the notebook starts) runs in a
sandbox of its own:

- filesystem: a read-only view of the system (/usr, /etc, the libraries) and of the Python environment (dtlab
  included); /sandbox/in, read-only, holding its own copy of its notebook and of the runs handed in with it (no
  other notebook); /sandbox/out, where the grader writes its result; /tmp and /dev/shm, empty size-limited tmpfs
  (the scratch disk, also HOME and TMPDIR). Nothing else: not the other submissions, not the autograder zips, not
  the CSV, not the home of whoever grades;
- network: a network namespace of its own with loopback only (gloo ranks still meet on 127.0.0.1);
- processes: a PID namespace: every process the notebook starts is killed when its grader ends (and when `dtlab
  grade` dies); an unprivileged uid (65534) in a user namespace of its own;
- limits: memory (RLIMIT_AS per process, default 4 GiB), processes (RLIMIT_NPROC, default 512), scratch disk (the
  tmpfs size, default 1 GiB), wall time (`--timeout`, as before). Linux does not enforce RLIMIT_NPROC for root, so
  when `dtlab grade` runs as root each sandbox's processes get a uid of their own, with no capabilities
  (`sandbox_uid`, `command`).

Two mechanisms: bubblewrap (`bwrap`, where installed and allowed) and plain Linux namespaces through util-linux's
`unshare`, `mount` and `pivot_root` (the same layout built by a short shell script). `auto` takes the first that
works here; with neither, `dtlab grade` refuses to run untrusted code unless `--sandbox none` is given.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import NamedTuple

from dtlab.course.limits import DEFAULT_DISK, Limits, MiB, limits_preexec
from dtlab.course.pidns import emptied, read_info

MECHANISMS = ("bwrap", "namespaces")
CHOICES = ("auto",) + MECHANISMS + ("none",)
UID = 65534  # nobody
ROOTLESS_UIDS = (2_000_000_000, 100_000_000)  # a root caller's sandboxes: uids from here, one drawn per sandbox


def setpriv(uid: int) -> list[str]:
    """A root caller's sandbox becomes `uid` with no capabilities, and no setuid program can give any back."""
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


def sandbox_uid() -> int:
    """The uid a sandbox's processes have outside it: the caller's own (mapped to UID inside a user namespace), or
    for a root caller one drawn for this sandbox alone, so that RLIMIT_NPROC, which counts a uid's processes across
    the machine, counts this sandbox's and no other's."""
    if os.geteuid() != 0:
        return os.geteuid()

    start, n = ROOTLESS_UIDS
    return start + secrets.randbelow(n)


class _Box(NamedTuple):
    """What one sandbox holds: the command it runs, its in and out boxes, its scratch disk (bytes), its environment
    and the uid it runs as; and the system paths bound read-only into it (`ro`) and the links among them."""

    argv: list
    inbox: str
    outbox: str
    disk: int
    env: dict
    uid: int
    ro: tuple
    links: tuple


IN, OUT, SCRATCH = "/sandbox/in", "/sandbox/out", "/tmp"


def ro_paths() -> tuple[list[str], list[str]]:
    """What the sandbox sees read-only: the system and the Python environment (dtlab included)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dtlab package (not its checkout)
    want = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", sys.prefix, sys.base_prefix, here]
    want += [os.path.realpath(p) for p in want]
    want += [os.path.dirname(os.path.realpath(sys.executable))]
    out = []
    for p in sorted(set(want), key=len):
        if os.path.exists(p) and not os.path.islink(p) and not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    links = [p for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32") if os.path.islink(p)]
    return out, links


def _env(extra: dict) -> dict:
    env = {
        "PATH": os.path.dirname(sys.executable) + ":/usr/local/bin:/usr/bin:/bin",
        "HOME": SCRATCH + "/home",
        "TMPDIR": SCRATCH,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "PYTHONNOUSERSITE": "1",
        "HF_HUB_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        # the dtlab this process imported (bound read-only by ro_paths), not whichever one the environment's own
        # path would find: a checkout run with PYTHONPATH beside an install of another copy grades with its own
        "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    }
    for k, v in os.environ.items():  # dtlab's and torch's own settings pass; secrets and paths do not
        if k.startswith(("DTLAB_", "OMP_", "MKL_", "GLOO_", "TORCH_")) and k != "DTLAB_REPLAY":
            env[k] = v
    env.update(extra)
    return env


def command(
    mech: str,
    argv: list[str],
    inbox: str,
    outbox: str,
    disk: int = DEFAULT_DISK,
    env: dict | None = None,
    uid: int = UID,
    info_fd: int | None = None,
) -> list[str]:
    """The command that runs `argv` in the sandbox `mech`, with `inbox` read-only at /sandbox/in and `outbox`
    writable at /sandbox/out; bubblewrap writes its sandbox's pid and namespaces to `info_fd` (dtlab.course.pidns).
    For an ordinary caller the sandbox's processes are UID inside a user namespace of their own; a root caller's
    sandbox makes no user namespace and drops to `uid` (`sandbox_uid`) itself (setpriv: no capabilities,
    no_new_privs), so that RLIMIT_NPROC binds (Linux does not enforce it for root, nor for a
    user namespace's uid mapped to root)."""
    ro, links = ro_paths()
    box = _Box(list(argv), inbox, outbox, disk, _env(env or {}), uid, tuple(ro), tuple(links))
    if mech == "bwrap":
        cmd = _bwrap(box)
        return cmd[:1] + ["--info-fd", str(info_fd)] + cmd[1:] if info_fd is not None else cmd
    if mech == "namespaces":
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        return [
            "unshare",
            *user,
            "--net",
            "--mount",
            "--pid",
            "--fork",
            "--kill-child",
            "--propagation",
            "private",
            "sh",
            "-c",
            _script(box),
        ]
    raise ValueError(f"no sandbox {mech!r} ({MECHANISMS})")


def _bwrap(box: _Box) -> list[str]:
    """`command` for bubblewrap: the namespaces, the scratch tmpfs, the read-only binds, the in/out boxes."""
    argv, inbox, outbox, disk, env, uid, ro, links = box
    root = os.geteuid() == 0
    if root:
        ns = [
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--cap-drop",
            "ALL",
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
            "--cap-add",
            "CAP_SETPCAP",
        ]
        argv = setpriv(uid) + argv
    else:
        ns = ["--unshare-all", "--uid", str(UID), "--gid", str(UID)]
    # the scratch tmpfs first, the read-only binds over it: an environment under /tmp (a CI's venv) stays seen
    cmd = [
        "bwrap",
        *ns,
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "dtlab-grade",
        "--clearenv",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(disk),
        "--tmpfs",
        "/dev/shm",
        "--perms",
        "1777",
        "--size",
        str(disk),
        "--tmpfs",
        SCRATCH,
        "--perms",
        "0777",
        "--dir",
        SCRATCH + "/home",
    ]
    parents = sorted(
        {
            os.path.dirname(p)[:i]
            for p in (*ro, IN, OUT)
            for i in range(2, len(os.path.dirname(p)) + 1)
            if os.path.dirname(p)[i : i + 1] in ("", "/")
        },
        key=len,
    )
    for d in parents:  # made 0755: bwrap as root makes them 0700, and UID could not reach what is under them
        cmd += ["--perms", "0755", "--dir", d]
    for p in ro:
        cmd += ["--ro-bind", p, p]
    for p in links:
        cmd += ["--symlink", os.readlink(p), p]
    cmd += ["--ro-bind", inbox, IN, "--bind", outbox, OUT, "--chdir", SCRATCH]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    return cmd + ["--remount-ro", "/", "--"] + argv


def _script(box: _Box) -> str:
    """The namespaces' sandbox, built as root (of a new user namespace, or the real root): a tmpfs root holding
    read-only binds (nosuid, nodev), a new /proc, a few devices, the scratch tmpfs; pivot_root into it, loopback up;
    then the grader runs as UID in a nested user namespace, or for the real root as `uid` through setpriv with no
    capabilities and no_new_privs (a setuid program in the read-only system then gives nothing)."""
    argv, inbox, outbox, disk, env, uid, ro, links = box
    q = shlex.quote
    if os.geteuid() == 0:
        drop = " ".join(setpriv(uid))
    else:
        drop = f"unshare --user --map-user={UID} --map-group={UID} --"
    root = os.path.join(os.path.dirname(os.path.abspath(outbox)), "sandbox-root")
    lines = [
        "set -e",
        f"R={q(root)}",
        "mkdir -p $R",
        "mount -t tmpfs -o size=64m,mode=755 tmpfs $R",
        "mkdir -p $R/tmp",
        f"mount -t tmpfs -o size={disk},mode=1777 tmpfs $R/tmp",  # under the binds, as
        "mkdir -m 777 $R/tmp/home",
    ]  # bwrap's is
    for p in ro:
        lines += [
            f"mkdir -p $R{q(p)}",
            f"mount --rbind {q(p)} $R{q(p)}",
            f"mount -o remount,bind,ro,nosuid,nodev $R{q(p)}",
        ]
    for p in links:
        lines.append(f"ln -s {q(os.readlink(p))} $R{q(p)}")
    lines += ["mkdir -p $R/proc $R/dev/shm $R/tmp $R/sandbox/in $R/sandbox/out $R/old", "mount -t proc proc $R/proc"]
    for d in ("null", "zero", "full", "random", "urandom", "tty"):
        lines += [f"touch $R/dev/{d}", f"mount --bind /dev/{d} $R/dev/{d}"]
    lines += [
        "ln -s /proc/self/fd $R/dev/fd",
        "ln -s /proc/self/fd/0 $R/dev/stdin",
        "ln -s /proc/self/fd/1 $R/dev/stdout",
        "ln -s /proc/self/fd/2 $R/dev/stderr",
        f"mount -t tmpfs -o size={disk},mode=1777 tmpfs $R/dev/shm",
        f"mount --bind {q(inbox)} $R/sandbox/in",
        "mount -o remount,bind,ro,nosuid,nodev $R/sandbox/in",
        f"mount --bind {q(outbox)} $R/sandbox/out",
        "ip link set lo up 2>/dev/null || true",
        "mount -o remount,ro $R",
        "cd $R",
        "pivot_root . old",
        "umount -l /old",
        "cd /tmp",
        f"exec {drop} env -i {' '.join(q(f'{k}={v}') for k, v in env.items())} {' '.join(q(a) for a in argv)}",
    ]
    return "\n".join(lines)


@functools.cache
def probe(mech: str) -> str | None:
    """None when `mech` works here (a sandbox is made and a process runs in it), else why not, in one line."""
    if mech == "bwrap" and not all(shutil.which(t) for t in ("bwrap", "setpriv")):
        return "bwrap or setpriv is not installed (apt-get install -y bubblewrap util-linux)"
    if mech == "namespaces" and not all(shutil.which(t) for t in ("unshare", "mount", "pivot_root", "setpriv")):
        return "util-linux's unshare, mount, pivot_root and setpriv are not all installed"
    return _try(mech)


def _try(mech: str) -> str | None:
    """Make a sandbox `mech` as grading does and run a process in it: None, or why it failed."""

    with tempfile.TemporaryDirectory(prefix="dtlab-probe-") as d:
        inbox, outbox = os.path.join(d, "in"), os.path.join(d, "out")
        os.makedirs(inbox)
        os.makedirs(outbox)
        os.chmod(d, 0o755)
        code = (
            "import os, socket, tempfile; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "tempfile.TemporaryFile(); open(os.path.join(os.environ['HOME'], 'x'), 'w'); "
            f"open({OUT + '/ok'!r}, 'w').write(str(os.getuid()))"
        )
        try:
            with prepared(mech, [sys.executable, "-c", code], inbox, outbox, Limits(disk=16 * MiB)) as (cmd, kw):
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=d, **kw)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{mech} could not start: {e}"
        if p.returncode != 0 or not os.path.exists(os.path.join(outbox, "ok")):
            tail = [ln for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
            return f"{mech} is not allowed here: {tail[-1] if tail else f'exit code {p.returncode}'}"
    return None


def available() -> dict:
    """{mechanism: None if it works here, else why not}."""
    return {m: probe(m) for m in MECHANISMS}


def choose(requested: str = "auto") -> str:
    """The mechanism `dtlab grade` uses: `requested` if it works here (ValueError if not), or with 'auto' the
    strongest that does (ValueError when none does: untrusted code is not run unsandboxed unless asked)."""
    if requested not in CHOICES:
        raise ValueError(f"--sandbox {requested!r}: one of {CHOICES}")
    if requested == "none":
        return "none"
    if requested != "auto":
        why = probe(requested)
        if why:
            raise ValueError(f"--sandbox {requested}: {why}")
        return requested
    reasons = available()
    for m in MECHANISMS:
        if reasons[m] is None:
            return m
    raise ValueError(
        "no sandbox is available on this machine ("
        + "; ".join(f"{m}: {r}" for m, r in reasons.items())
        + "): dtlab grade runs every submission's code and refuses to do so unsandboxed; install "
        "bubblewrap (apt-get install -y bubblewrap), or pass --sandbox none to run it with your "
        "permissions"
    )


def open_to_sandbox(inbox: str, outbox: str, uid: int) -> None:
    """Let a sandbox that runs as `uid` in the real user namespace (a root caller's: see `prepared`) read its inbox
    and write its outbox: a world-readable inbox, an outbox owned by `uid`."""
    for d, _, files in os.walk(inbox):
        os.chmod(d, 0o755)
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                os.chmod(p, 0o644)
    os.chown(outbox, uid, uid)


@contextlib.contextmanager
def prepared(
    mech: str,
    argv: list[str],
    inbox: str,
    outbox: str,
    limits: Limits | None = None,
    env: dict | None = None,
    pass_fds=(),
):
    """(command, Popen keyword arguments) that run `argv` in the sandbox `mech` with `limits` set; for a root
    caller, whose sandbox runs as a uid of its own in the real user namespace (`command`), the inbox is made
    readable and the outbox writable by it first. Run and wait for the command inside the `with`: leaving it waits
    until no process of the sandbox is left (dtlab.course.pidns), so the outbox can be read and removed. `limits`:
    dtlab.course.limits.Limits, its defaults when None."""
    limits = limits or Limits()
    uid = sandbox_uid()
    if os.geteuid() == 0:
        open_to_sandbox(inbox, outbox, uid)
    info_r, info_w = os.pipe() if mech == "bwrap" else (None, None)
    try:
        yield (
            command(mech, argv, inbox, outbox, disk=limits.disk, env=env, uid=uid, info_fd=info_w),
            {
                "preexec_fn": limits_preexec(limits.memory, limits.procs),
                "pass_fds": tuple(pass_fds) + ((info_w,) if info_w is not None else ()),
            },
        )
    finally:
        if info_w is not None:
            os.close(info_w)
            info = read_info(info_r)
            os.close(info_r)
            emptied(info)
