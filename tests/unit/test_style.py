"""The house style, checked: ruff's formatter and linter (configuration in pyproject.toml: 120 columns, import
sorting, pycodestyle, pyflakes, bugbear, pyupgrade) over the whole tree, short functions, and imports at the top of
a module unless one avoids a cycle or a heavy import on a path that must stay light."""

import ast
import pathlib
import subprocess
import sys

import pytest

from .source_tree import functions, modules

#: these checks walk the parsed package (tests/unit/source_tree.py): one worker parses it for all of them
pytestmark = pytest.mark.xdist_group("source-tree")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TREE = ["dtlab", "tests", "tools", "benchmarks"]
MAX_FUNCTION_LINES = 80
#: imports inside functions in dtlab/: each avoids a cycle, a heavy import (torch, pandas, plotly, IPython) on a path
#: that must stay light (`import dtlab`, `dtlab --help`, the agent before its lifeline), or an optional extra
MAX_IMPORTS_IN_FUNCTIONS = 100


def _ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args, *TREE], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("args", [("format", "--check"), ("check",)], ids=["format", "lint"])
def test_ruff_passes(args):
    r = _ruff(*args)
    assert r.returncode == 0, f"ruff {' '.join(args)}:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"


def test_no_function_is_over_80_lines():
    sizes = [(p, f, f.end_lineno - f.lineno + 1) for p, f in functions()]
    long = [f"{p}:{f.lineno} {f.name} ({n} lines)" for p, f, n in sizes if n > MAX_FUNCTION_LINES]
    assert not long, long


def _imports_in_functions() -> list[str]:
    found = []
    for path, f in functions():
        for stmt in ast.walk(f):
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                found.append(f"{path}:{stmt.lineno}")
    return sorted(set(found))  # a nested function's imports are walked from its parent too: count each once


def test_imports_sit_at_the_top_of_their_modules():
    inside = _imports_in_functions()
    assert len(inside) <= MAX_IMPORTS_IN_FUNCTIONS, f"{len(inside)} imports inside functions: {inside}"


def _needless_imports(tree: ast.Module, where: str) -> list[str]:
    """Imports inside functions that defer nothing: the standard library (already loaded or cheap), or a module the
    file also imports at its top."""
    top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    top |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    out = []
    for f in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for stmt in ast.walk(f):
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                name = stmt.module if isinstance(stmt, ast.ImportFrom) else stmt.names[0].name
                if name and (name.split(".")[0] in sys.stdlib_module_names or name in top):
                    out.append(f"{where}:{stmt.lineno} {name}")
    return out


def test_no_import_inside_a_function_defers_nothing():
    found = [x for path, tree in modules() for x in _needless_imports(tree, str(path.relative_to(ROOT)))]
    assert not found, found


def test_a_needless_import_is_found():
    planted = ast.parse(
        "import os\nfrom dtlab.units import fmt_ms\n"
        "def f():\n    import json\n    from dtlab.units import fmt_ms\n    import torch\n"
    )
    assert [x.split()[1] for x in _needless_imports(planted, "x")] == ["json", "dtlab.units"]


def test_the_counters_count():
    """The two walks above find what they look for (a check that found nothing would pass anything)."""
    assert any(f.name == "main" for _, f in functions())
    assert _imports_in_functions(), "dtlab has lazy imports (torch on the CLI's path): the walk must see them"
