"""The house rules of the code, read from its imports (every import, deferred ones included):
no import circle, and no arrow from a lower floor to a higher one, between the top-level folders
(schemas <- privacy <- trainer <- pipelines <- bench <- ssp) and between the stages inside pipelines/
(base <- data <- releases <- engines <- training <- the thin entry scripts at pipelines/ itself)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = ("schemas", "privacy", "trainer", "pipelines", "bench", "ssp")
STAGES = ("base", "data", "releases", "engines", "training")
ENTRY_SCRIPTS = {"pipelines.stats", "pipelines.beam_stats", "pipelines.user_update"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for top in TOP for path in (ROOT / top).rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from a import b` counts as a.b where b is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def floor(module: str) -> tuple[int, int]:
    """(top-level folder, stage inside pipelines/): imports may only point to an equal or lower floor."""
    parts = module.split(".")
    top = TOP.index(parts[0])
    if parts[0] != "pipelines" or len(parts) == 1:
        return top, 0
    if module in ENTRY_SCRIPTS:
        return top, len(STAGES)
    return top, STAGES.index(parts[1])


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_every_module_belongs_to_a_floor():
    for module in _modules():
        floor(module)  # a module outside the known floors raises here


def test_no_import_points_up():
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if not module.startswith(target + ".") and floor(target) > floor(module)
    )
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


def test_no_import_circle():
    graph, state, circles = _graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if module.startswith(
                target + "."
            ):  # a module imports its own package's __init__: not an arrow between modules
                continue
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize(
    "module, target, allowed",
    [
        ("pipelines.data.splits", "pipelines.releases.counts", False),
        ("pipelines.training.stages", "pipelines.engines.spark", True),
        ("pipelines.engines.spark", "ssp.cli", False),
        ("bench.audit", "pipelines.training.stages", True),
        ("pipelines.stats", "pipelines.training.item_update", True),
        ("trainer.ssp", "pipelines.base.logs", False),
    ],
)
def test_the_floors_order_as_documented(module, target, allowed):
    assert (floor(target) <= floor(module)) == allowed


def test_every_library_module_ends_its_docstring_with_its_privacy_paragraph():
    """What a module does with private data is said where a reader starts: the last paragraph of
    its docstring begins `Privacy:` (bench/ and the tests are not the product)."""
    missing = []
    for name, path in _modules().items():
        if name.split(".")[0] in ("bench", "tests"):
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not docstring.strip().split("\n\n")[-1].startswith("Privacy:"):
            missing.append(name)
    assert not missing, missing
