"""The documentation: the site builds with `mkdocs build --strict` (a broken link between pages fails it), the README
stays short with its two Quickstart commands, and no page names internal planning documents or issue numbers
instead of the ideas and sources they stand for."""

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README_LIMIT = 12 * 1024  # bytes
#: Internal references a reader cannot follow: "issue 12", "(issue 13)", "issues #4", "seed 002".
INTERNAL = re.compile(r"\bissues?\s+#?\d+|\bseed\s+0\d\d", re.IGNORECASE)


def _user_facing_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", ROOT / "labs" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _quickstart_commands(text: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.quickstart_commands(text)


def _mkdocs_build(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `config` into `site`, run from the config's folder (the snippets' base path).
    Never with -q: mkdocs 1.6 then drops warnings before strict mode counts them, and a broken link passes."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install mkdocs-material, in the test extra)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_builds_strictly(tmp_path):
    cp = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").is_file()
    rubric = (tmp_path / "site" / "rubric" / "index.html").read_text()
    assert "lab08.hook" in rubric and "--8&lt;--" not in rubric, (
        "the rubric page did not include labs/README.md's tables"
    )


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f": {p.name}" not in nav]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build is only worth something if it catches a broken link: plant one in a copy."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "labs").mkdir()
    shutil.copy(ROOT / "labs" / "README.md", tmp_path / "labs" / "README.md")
    page = tmp_path / "docs" / "testing.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    cp = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert cp.returncode != 0, "mkdocs build --strict passed with a broken link"
    assert "no-such-page.md" in cp.stdout + cp.stderr


def test_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move the detail into docs/"


def test_quickstart_still_has_its_two_commands():
    cmds = _quickstart_commands((ROOT / "README.md").read_text())
    assert len(cmds) == 2, cmds
    assert all(c.startswith("pip install torch==") for c in cmds), cmds
    # every test but the slow ones, on every core; the README says how to run the slow ones, and CI runs them
    assert cmds[1].endswith('python -m pytest -q -n auto --dist loadgroup -m "not slow"'), cmds[1]
    text = (ROOT / "README.md").read_text()
    assert "python -m pytest -q -n auto --dist loadgroup -m slow" in text
    assert '-m "not slow"' in (ROOT / ".ci" / "run").read_text() and "-m slow" in (ROOT / ".ci" / "run").read_text()


def test_no_internal_references():
    hits = []
    for path in _user_facing_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}" for m in INTERNAL.finditer(line)]
    assert not hits, "name the idea and cite its source instead:\n" + "\n".join(hits)


def test_the_internal_reference_pattern_catches_what_it_should():
    for text in ("(issue 12, first levers)", "Issue 13", "issues #4", "seed 002's example", "Seed 001"):
        assert INTERNAL.search(text), text
    for text in ("the hook's issuing 25-37 us", "issued 3 times", "seed 0", "seed=0", "my_seed_wait_ms"):
        assert not INTERNAL.search(text), text
