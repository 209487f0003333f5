"""binder/ follows repo2docker's conventions and installs what the README installs; the labs quote no
number that only holds for one model while quick mode (Binder's default) runs another.

Static checks of files: nothing is built or installed here."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


BINDER = ROOT / "binder"


LABS = ROOT / "labs"


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def readme_torch_pin() -> str:
    """The torch version the README (and so CI, which runs the README's commands) installs first."""
    m = re.search(r"pip install torch==([0-9][0-9.]*)", (ROOT / "README.md").read_text())
    assert m, "the README no longer pins torch"
    return m.group(1)


def commands(path: pathlib.Path) -> list[str]:
    """The non-comment lines of a shell script, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def pip_installs(line: str) -> list[str] | None:
    """The words after `pip install` in a command line (None if it is not a pip install)."""
    words = shlex.split(line)
    for i in range(len(words) - 1):
        if words[i].endswith("pip") and words[i + 1] == "install":
            return words[i + 2 :]
    return None


def git_mode(path: pathlib.Path) -> str | None:
    """The file mode git has staged or committed for `path` (e.g. '100755'), None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-s", str(path.relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.split()[0] if out.returncode == 0 and out.stdout.strip() else None


def test_runtime_txt_names_a_supported_python():
    text = (BINDER / "runtime.txt").read_text().strip()
    m = re.fullmatch(r"python-(3)\.(\d+)", text)
    assert m, f"runtime.txt must read like 'python-3.11' (repo2docker), got {text!r}"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = re.fullmatch(r">=3\.(\d+)", requires)
    assert floor, f"pyproject.toml's requires-python should read like '>=3.11', got {requires!r}"
    assert int(m.group(2)) >= int(floor.group(1)), f"pyproject.toml requires Python 3.{floor.group(1)} or newer"


@pytest.mark.parametrize("script", ["postBuild", "start"])
def test_scripts_are_executable_shell_scripts(script):
    path = BINDER / script
    if script == "start" and not path.exists():
        pytest.skip("no binder/start")
    assert path.read_text().startswith("#!"), f"binder/{script} needs a shebang line"
    assert os.stat(path).st_mode & 0o111, f"binder/{script} is not executable (chmod +x)"
    mode = git_mode(path)
    assert mode in (None, "100755"), f"git records binder/{script} as {mode}: repo2docker needs mode 100755"
    if script == "start":
        assert commands(path)[-1] == 'exec "$@"', 'binder/start must end with exec "$@" (repo2docker)'


def test_postbuild_installs_the_readme_torch_before_the_project():
    pin = readme_torch_pin()
    lines = commands(BINDER / "postBuild")
    torch_at = project_at = None
    for i, line in enumerate(lines):
        words = pip_installs(line)
        if words is None:
            continue
        if torch_at is None and any(w.split("+")[0] == f"torch=={pin}" for w in words):
            torch_at = i
            assert f"torch=={pin}+cpu" in words or ("--index-url" in words and CPU_INDEX in words), (
                f"postBuild's torch install can pick a CUDA build: {line!r}"
            )
        if project_at is None and ("." in words or "-e" in words and words[words.index("-e") + 1] == "."):
            project_at = i
            assert not {"-U", "--upgrade", "--force-reinstall"} & set(words), (
                f"installing the project must not replace torch: {line!r}"
            )
    assert torch_at is not None, f"postBuild does not install torch=={pin} (the README's pin)"
    assert project_at is not None, "postBuild does not install the project (pip install -e .)"
    assert torch_at < project_at, "postBuild must install torch before the project"


def test_requirements_cannot_pull_a_cuda_torch():
    pin = readme_torch_pin()
    lines = [
        ln.strip()
        for ln in (BINDER / "requirements.txt").read_text().splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]
    only_cpu_index = any(
        ln.split()[:2] == ["--index-url", CPU_INDEX] or ln == f"--index-url={CPU_INDEX}" for ln in lines
    )
    reqs = [ln for ln in lines if not ln.startswith("-")]
    torch_lines = [ln for ln in reqs if re.match(r"torch\b(?![-_])", ln)]
    assert torch_lines, "binder/requirements.txt should install the CPU torch wheel"
    for ln in torch_lines:
        assert ln.startswith(f"torch=={pin}"), f"{ln!r}: not the README's torch=={pin}"
        assert ln == f"torch=={pin}+cpu" or only_cpu_index, (
            f"{ln!r} can resolve to PyPI's CUDA build: pin {pin}+cpu, or use --index-url {CPU_INDEX}"
        )
    assert not [ln for ln in reqs if re.match(r"nvidia-|.*cu\d\d", ln)], "CUDA packages in binder/requirements.txt"


#: DistilBERT-base's parameter count and gradient bytes, however they are written. Quick mode (the tests,
#: Binder) runs the tiny model, so a lab that states them as facts about "the model" tells the student
#: something the run in front of them contradicts.


DISTILBERT_NUMBERS = re.compile(r"66[,_ ]?955[,_ ]?010|66\.9\d*\s*M|\b67\s*M\b|267[,_ ]?820[,_ ]?040")
#: A markdown line may still quote them when it says, on that line, which config they belong to
#: (DistilBERT in full mode, DistilBERT-base) or that the value is the one printed from the config in use.


SAYS_WHICH_CONFIG = re.compile(
    r"full mode|DistilBERT-base|printed (above|below)|from the config|cfg\.model|"
    r"run\.resolved",
    re.I,
)


def lab_cells():
    for path in sorted(LABS.glob("*.ipynb")):
        nb = json.loads(path.read_text())
        for i, c in enumerate(nb["cells"]):
            yield path.name, i, c["cell_type"], "".join(c["source"])


def test_labs_quote_no_hard_coded_distilbert_count():
    bad = []
    for name, i, kind, text in lab_cells():
        for line in text.splitlines():
            # code must compute the number (from cfg or run.resolved), never print a literal
            if DISTILBERT_NUMBERS.search(line) and (kind == "code" or not SAYS_WHICH_CONFIG.search(line)):
                bad.append(f"{name} cell {i} ({kind}): {line.strip()!r}")
    assert not bad, (
        "labs state DistilBERT's numbers as facts while quick mode runs the tiny model; print them "
        "from the config in use (cfg / run.resolved) or say which config they belong to:\n" + "\n".join(bad)
    )


def test_the_check_itself_flags_the_old_lab01_text():
    """The check above is only worth something if it catches what lab 1 used to say."""
    old = "DistilBERT has 66,955,010 parameters. In fp32 each gradient is 4 bytes, and DDP all-reduces every"
    assert DISTILBERT_NUMBERS.search(old) and not SAYS_WHICH_CONFIG.search(old)
    ok = "The model in use has `n_params` parameters (printed above, from `cfg.model`)."
    assert not DISTILBERT_NUMBERS.search(ok)


def test_ci_runs_the_readme_commands_in_a_fresh_environment():
    """CI builds an empty virtual environment and runs the README's Quickstart commands as written: a machine
    that already has a package installed must not hide a missing install step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cmds = mod.quickstart_commands((ROOT / "README.md").read_text())
    assert len(cmds) == 2
    assert "python -m pytest" in cmds[1], "command 2 must run the test suite"
    assert cmds[0].startswith("pip install torch==") and cmds[1].startswith("pip install torch==")
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"python3 -m venv \"\$venv\"\s", ci) and "--system-site-packages" not in ci.replace(
        "no --system-site-packages", ""
    )
    assert "readme_commands.py README.md" in ci
    # CI runs the README's commands written out, each at the start of its own line and stopping CI with its own
    # exit status when it fails, and refuses a README that differs from them
    for cmd in cmds:
        assert re.search("^" + re.escape(cmd) + r' \|\| \{ rc=\$\?;.*exit "\$rc"; \}$', ci, flags=re.M), cmd
