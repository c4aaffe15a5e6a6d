"""Docs stay out of the library code: no measured figure (a number with four decimals, such as a
test RMSE) in a comment, docstring or string of the library packages, whose measurements belong in
docs/results.md, and no module docstring over 300 words, whose long specifications belong in docs/.
Numeric literals are code, not figures, so only comments and strings are read (`tokenize`)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "privacy", "trainer", "pipelines", "ssp")
FIGURE = re.compile(r"(?<![\w.])\d+\.\d{4}(?!\d)")
MAX_DOCSTRING_WORDS = 300
TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING} | {
    getattr(tokenize, name) for name in ("FSTRING_MIDDLE",) if hasattr(tokenize, name)
}


def _modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def figures(source: str) -> list[tuple[int, str]]:
    """(line, figure) of every four-decimal number in the comments and string literals of `source`."""
    return [
        (token.start[0], match.group())
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type in TEXT_TOKENS
        for match in FIGURE.finditer(token.string)
    ]


def test_the_figure_pattern():
    assert figures('x = 0.9090  # test RMSE 0.9090\ny = "at 0.1234"\n') == [(1, "0.9090"), (2, "0.1234")]
    assert figures("z = 1.2345\n# 1e-5, 0.93, 10.5, v1.2.3456, 0.12345\n") == []


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_no_measured_figures_in_comments_docstrings_or_strings(path):
    found = figures(path.read_text())
    assert not found, (
        f"{_name(path)}: measured figures belong in docs/results.md (leave a one-line why and a link): "
        + ", ".join(f"line {line}: {figure}" for line, figure in found)
    )


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_module_docstrings_are_at_most_300_words(path):
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    words = len(docstring.split())
    assert words <= MAX_DOCSTRING_WORDS, (
        f"{_name(path)}: module docstring of {words} words; keep a summary and its Privacy: paragraph, "
        "and move the specification to a page under docs/"
    )
