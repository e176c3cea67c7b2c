"""The documentation stays true to the tree: it fails when the docs drift from the code.

- README.md stays a short page for users, with one line of results and no other figure;
  measurements live in docs/results.md.
- Every relative link in README.md and docs/*.md points at a file that exists, and every
  `#anchor` into a markdown file names one of its headings (code comments point at
  docs/results.md headings, so those are checked wherever they are quoted).
- docs/architecture.md mentions every top-level module and package of src/oakemu_rl/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "oakemu_rl"

README_MAX_LINES = 150

# docs/cli.md is generated from the command-line options by a separate change; until it
# lands, links to it are allowed by this one name. Once the file exists it is checked like
# every other link.
NOT_YET_WRITTEN = {DOCS / "cli.md"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
# A measured figure: a number with a unit of time, speed, size or share, or a ± error.
FIGURE = re.compile(
    r"±|\d[\d,.]*\s?(%|x\b|min\b|minutes?\b|s\b|seconds?\b|ms\b|SPS\b|steps/s\b"
    r"|samples/s\b|frames/s\b|[KMG]B\b)"
)


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link outside code blocks."""
    return [(number, target) for number, line in prose_lines(path)
            for target in LINK.findall(line)]


def slug(heading: str) -> str:
    """The anchor a markdown renderer gives a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for _, line in prose_lines(path)
            if re.match(r"#{1,6} ", line)}


def test_readme_is_short() -> None:
    count = len(README.read_text().splitlines())
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines (at most {README_MAX_LINES}): move detail to docs/")


def test_readme_quotes_figures_on_one_line_only() -> None:
    """Figures belong in docs/results.md; the README keeps one line of current results,
    and that line links there."""
    with_figures = [(number, line) for number, line in prose_lines(README)
                    if FIGURE.search(line)]
    tables = [(number, line) for number, line in with_figures if line.lstrip().startswith("|")]
    assert not tables, f"README.md has a table of figures: {tables}"
    assert len(with_figures) <= 1, (
        f"README.md quotes figures on more than one line: {with_figures}")
    for number, line in with_figures:
        assert "docs/results.md" in line, (
            f"README.md line {number} quotes a figure without linking docs/results.md")


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path: Path) -> None:
    broken = []
    for number, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a web address, mail, or an anchor on the same page
        file = (path.parent / target.split("#", 1)[0]).resolve()
        if file in NOT_YET_WRITTEN and not file.exists():
            continue
        if not file.exists():
            broken.append(f"line {number}: {target}")
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_anchors_name_headings(path: Path) -> None:
    broken = []
    for number, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or "#" not in target:
            continue
        name, anchor = target.split("#", 1)
        file = (path.parent / name).resolve() if name else path
        if file.suffix == ".md" and file.exists() and anchor not in anchors(file):
            broken.append(f"line {number}: {target}")
    assert not broken, f"{path.relative_to(ROOT)} links to missing headings: {broken}"


def test_results_anchors_quoted_in_the_tree_exist() -> None:
    """Code comments and pipeline files name the docs/results.md heading that holds a
    figure instead of quoting it; each such anchor must exist."""
    known = anchors(DOCS / "results.md")
    quoted = re.compile(r"docs/results\.md#([\w-]+)")
    broken = []
    for folder in ("src", "pipelines", "benchmarks", "scripts", "tests"):
        for file in sorted((ROOT / folder).rglob("*")):
            if not file.is_file() or file.suffix not in {".py", ".toml", ".md", ".sh"}:
                continue
            for anchor in quoted.findall(file.read_text(errors="replace")):
                if anchor not in known:
                    broken.append(f"{file.relative_to(ROOT)}: #{anchor}")
    assert not broken, f"anchors into docs/results.md that name no heading: {broken}"


def package_modules() -> list[str]:
    """Top-level modules and packages of oakemu_rl, as the tree has them now."""
    names = []
    for entry in sorted(PACKAGE.iterdir()):
        if entry.name.startswith(("_", ".")):
            continue  # __init__.py, __main__.py, caches
        if entry.is_file() and entry.suffix == ".py":
            names.append(entry.stem)
        elif entry.is_dir() and (entry / "__init__.py").exists():
            names.append(entry.name)
    return names


def test_architecture_mentions_every_module() -> None:
    """A new module fails here until docs/architecture.md places it in the module map.
    A module counts as mentioned as `name.py` or `name/` (`name/` also by a path below it,
    such as `name/part.py`), in backquotes."""
    text = (DOCS / "architecture.md").read_text()
    names = package_modules()
    assert names, "found no modules under src/oakemu_rl"
    missing = [name for name in names
               if not re.search(rf"`{re.escape(name)}(\.py`|/)", text)]
    assert not missing, f"docs/architecture.md does not mention: {missing}"
