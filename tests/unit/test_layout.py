"""The package's shape: the layers of pyproject.toml's import contracts hold (`lint-imports`), no import circle
among dtlab modules (top-level or deferred imports alike), no private name imported across modules, no module over
450 lines (files split by idea stay around 400), every public name and CLI command there, CLI flags and defaults
that are the config's own, `python -m dtlab`."""

import ast
import dataclasses
import pathlib
import subprocess
import sys

import pytest

from .source_tree import modules

#: these checks walk the parsed package (tests/unit/source_tree.py): one worker parses it for all of them
pytestmark = pytest.mark.xdist_group("source-tree")

PKG = pathlib.Path(__file__).resolve().parents[2] / "dtlab"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """dtlab module -> dtlab modules it imports anywhere in its body (deferred imports count: a circle through a
    function-level import is still a circle)."""
    trees = {_module_name(p): (p, tree) for p, tree in modules()}
    mods = {m: p for m, (p, _) in trees.items()}
    graph = {m: set() for m in mods}
    for mod, (path, tree) in trees.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in mods and t != mod and t != "dtlab":
                    graph[mod].add(t)
    return graph


def find_cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                c = visit(m)
                if c:
                    return c
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            c = visit(n)
            if c:
                return c
    return None


ROOT = PKG.parent

#: The public API (dtlab.__all__) and the command line: a move inside the package must keep every one of them.
PUBLIC_NAMES = {
    "load_nccl_tests",
    "public_nccl_tests",
    "RunConfig",
    "whatif",
    "WhatIf",
    "Link",
    "TwoLevelLink",
    "ZeroConfig",
    "CalibConfig",
    "tiny",
    "launch",
    "run",
    "Handle",
    "calibrate",
    "sweep",
    "submit",
    "Emulation",
    "Run",
    "load_run",
    "RunFailed",
    "rank_waits",
    "run_waits",
    "sync_step_model",
    "Profile",
    "load_profile",
    "predict",
    "recorded_runs",
    "recorded_run",
    "recorded_calibration",
    "load_trace",
    "Trace",
    "public_trace",
    "cost",
    "PriceTable",
    "GpuPrice",
    "example_prices",
    "spot_plan",
}
COMMANDS = ("run", "show", "trace", "calibrate", "nccl-tests", "assign", "grade", "slurm", "emulate", "doctor")


def test_import_contracts_hold():
    """pyproject.toml's contracts: the layers (cli > course > launching | viz > results > model | rank > config >
    runfiles > units | intervals) and no torch or widgets in the pure layers."""
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    cp = subprocess.run(
        [str(exe), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-2000:]
    assert "0 broken" in cp.stdout


def private_uses(tree, where: str) -> list[str]:
    """`from dtlab.x import _name`, and `mod._name` where `mod` is a dtlab module imported by name."""
    bad, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dtlab"):
            bad += [
                f"{where}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and a.name != "__version__"
            ]
            modules |= {a.asname or a.name for a in node.names}  # may be modules: dtlab.model import costmodel
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name.startswith("dtlab") and a.asname}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            bad.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
    return bad


def test_no_private_name_is_used_across_modules():
    bad = [b for path, tree in modules() for b in private_uses(tree, str(path.relative_to(ROOT)))]
    assert not bad, "\n".join(bad)
    planted = ast.parse("from dtlab.model import costmodel\nfrom dtlab.x import _y\ncostmodel._out(1)")
    assert private_uses(planted, "m") == ["m: from dtlab.x import _y", "m:3: costmodel._out"]


def _strategy_comparisons(tree) -> list[int]:
    """Lines comparing something named like a strategy with a string (or strings): `cfg.strategy == "zero3"`."""

    def strategyish(node):
        return any(
            isinstance(n, (ast.Name, ast.Attribute, ast.Constant))
            and "strategy" in str(getattr(n, "id", getattr(n, "attr", getattr(n, "value", ""))))
            for n in ast.walk(node)
        )

    def strings(node):
        return (isinstance(node, ast.Constant) and isinstance(node.value, str)) or (
            isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(strings(e) for e in node.elts)
        )

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(strategyish(s) for s in sides) and any(strings(s) for s in sides):
                lines.append(node.lineno)
    return lines


def test_strategy_names_are_compared_only_in_their_specs():
    """What a strategy supports is its spec in dtlab.config.strategies; no other module compares names."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for path, tree in modules()
        if path.name != "strategies.py" or path.parent.name != "config"
        for line in _strategy_comparisons(tree)
    ]
    assert not bad, "strategy names compared outside dtlab/config/strategies.py: " + ", ".join(bad)
    planted = ast.parse('if cfg.strategy == "zero3":\n    pass\nif run.config.strategy in ("ddp", "ps"):\n    pass')
    assert _strategy_comparisons(planted) == [1, 3]


def test_every_public_name_resolves():
    import dtlab

    assert set(dtlab.__all__) == PUBLIC_NAMES
    for name in sorted(PUBLIC_NAMES):
        assert getattr(dtlab, name) is not None, name


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_answers_help(command, capsys):
    from dtlab.cli.main import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert f"dtlab {command}" in capsys.readouterr().out


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _defaults(cls, group=""):
    """{argparse name: default} of every field, an option group's fields under their flat names where
    dtlab.config.options gives them (parallel.schedule -> pp_schedule), under group_field otherwise (zero_...)."""
    from dtlab.config.options import FLAT_NAME

    out = {}
    for f in dataclasses.fields(cls):
        d = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(d):
            out.update(_defaults(type(d), group=f.name))
        else:
            out[FLAT_NAME.get((group, f.name), f"{group}_{f.name}" if group else f.name)] = d
    return out


@pytest.mark.parametrize("command,cls", [("run", "RunConfig"), ("calibrate", "CalibConfig")])
def test_cli_defaults_are_the_config_defaults(command, cls):
    """Every config field has a flag, and parsing no flags gives the config's own default for each."""
    from dtlab.cli.main import build_parser
    from dtlab.config.calibration import CalibConfig
    from dtlab.config.run import RunConfig

    klass = {"RunConfig": RunConfig, "CalibConfig": CalibConfig}[cls]
    args = vars(build_parser().parse_args([command]))
    want = _defaults(klass)
    skipped = {"ops", "sizes", "fit_min_bytes", "fit_max_bytes"} if command == "calibrate" else set()
    for name, default in want.items():
        if name in skipped:
            continue
        assert name in args, f"--{name.replace('_', '-')} is missing from `dtlab {command}`"
        assert args[name] == default, f"`dtlab {command}` --{name}: {args[name]!r} != config default {default!r}"


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_over_450_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= 450, f"dtlab/{path.relative_to(PKG)} has {n} lines: split it by concern"


LABS = sorted((ROOT / "labs").glob("*.ipynb")) + sorted((ROOT / "instructor").glob("*.ipynb"))
#: what an instructor master's hidden tests import: stripped from the student's notebook by `dtlab assign`
HIDDEN_TESTS = ("dtlab.course.autograde", "dtlab.course.rubric")


def _dtlab_imports(src: str) -> set[str]:
    clean = "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())
    out = set()
    for node in ast.walk(ast.parse(clean)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dtlab":
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "dtlab"}
    return out


@pytest.mark.parametrize("path", LABS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_lab_imports_only_dtlab_and_its_lab_module(path):
    """A lab is a reader's entry: it reaches dtlab through `dtlab` and `dtlab.lab`, not through the internals."""
    import json

    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    found = set().union(*(_dtlab_imports("".join(c["source"])) for c in cells))
    other = {m for m in found - {"dtlab", "dtlab.lab"} if not m.startswith(HIDDEN_TESTS)}
    assert not other, f"{path.name} imports {sorted(other)}: use dtlab or dtlab.lab"


def test_the_planted_internal_import_is_found():
    assert _dtlab_imports("import dtlab\nfrom dtlab.viz.figures import x\n%matplotlib inline") == {
        "dtlab",
        "dtlab.viz.figures",
    }


def test_every_lab_name_resolves_documented_and_is_no_second_name():
    import dtlab
    import dtlab.lab as lab

    assert not set(lab.__all__) & set(dtlab.__all__), "a name of dtlab's public API is given a second one"
    for name in lab.__all__:
        value = getattr(lab, name)
        assert (getattr(value, "__doc__", None) or "").strip(), f"dtlab.lab.{name} has no documentation"


def _listing(path: pathlib.Path, heading: str) -> set[str]:
    """The words of the first code block after `heading` in a Markdown file: the module listing."""
    import re

    block = path.read_text().split(heading, 1)[1].split("```")[1]
    return set(re.findall(r"\w+", block))


def _unlisted(words: set[str], depth: int | None) -> list[str]:
    """dtlab's modules and subpackages (at most `depth` folders deep) whose name the listing lacks; one module per
    lab (claims/lab05.py, rubric/lab05.py) counts as listed when its folder is."""
    import re

    missing = []
    for path in sorted(PKG.rglob("*")):
        rel = path.relative_to(PKG)
        if "__pycache__" in rel.parts or path.name == "__init__.py" or (depth and len(rel.parts) > depth):
            continue
        if path.is_dir() and not (path / "__init__.py").exists():
            continue  # a data folder (recorded runs, public traces)
        if path.suffix not in (".py", "") or (path.suffix == "" and not path.is_dir()):
            continue
        if re.fullmatch(r"lab\d\d", path.stem) and path.parent.name in words:
            continue
        if path.stem not in words:
            missing.append(str(rel))
    return missing


def test_the_readme_lists_every_module():
    """The README's tree names every module of each layer and every subpackage (their insides: docs/layout.md)."""
    assert not _unlisted(_listing(ROOT / "README.md", "## The code"), depth=2)


def test_the_layout_page_lists_every_module():
    assert not _unlisted(_listing(ROOT / "docs" / "layout.md", "## Module by module"), depth=None)


def test_an_unlisted_module_is_found():
    assert "lab.py" in _unlisted({"cli", "doctor"}, depth=1)


@pytest.mark.parametrize("path", sorted((ROOT / "labs").glob("*.ipynb")), ids=lambda p: p.stem)
def test_a_lab_imports_the_checks_in_its_check_cells_only(path):
    """Grading tells a check cell by its import of the checks (dtlab.course.integrity.CHECK_MARK): every cell that
    calls a check must import it, and no other cell may, or an edited check cell would go unnoticed."""
    import json
    import re

    from dtlab.course.integrity import CHECK_MARK

    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    calls = [i for i, s in enumerate(cells) if re.search(r"^\s*check(_exercise)?\(", s, re.M)]
    marked = [i for i, s in enumerate(cells) if CHECK_MARK.search(s)]
    assert calls and calls == marked, f"cells calling a check {calls}, cells importing it {marked}"
