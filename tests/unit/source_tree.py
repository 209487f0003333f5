"""dtlab's modules read and parsed once per test process: the style and layout checks (test_style.py,
test_layout.py) walk the same trees, and each reading the whole package itself cost about 1 s a walk (seven walks)."""

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "dtlab"


@functools.cache
def modules() -> tuple[tuple[pathlib.Path, ast.Module], ...]:
    """(path, parsed module) for every dtlab module, sorted by path. Shared: a test must not change a tree."""
    return tuple((p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(PKG.rglob("*.py")))


@functools.cache
def functions() -> tuple[tuple[pathlib.Path, ast.FunctionDef | ast.AsyncFunctionDef], ...]:
    """(path relative to the checkout, node) for every function and method in dtlab, nested ones included."""
    return tuple(
        (path.relative_to(ROOT), node)
        for path, tree in modules()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    )
