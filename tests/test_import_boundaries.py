"""DESIGN.md's import arrows that the policy contract rests on: serving a policy needs no Python
from `trainer` (policy.json is the whole contract), and `benchmarks/` stays a leaf that both
sides may import. Checked on the source, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package → top-level packages of ours it must never import
FORBIDDEN = {
    "services": {"trainer"},
    "benchmarks": {"trainer", "services"},
}


def imported_packages(path: Path) -> dict[str, int]:
    """Top-level package → first line that imports it (absolute imports only)."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.setdefault(name.split(".")[0], node.lineno)
    return found


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_package_does_not_import_what_design_forbids(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files
    offending = [f"{path.relative_to(REPO)}:{line} imports {name}"
                 for path in files for name, line in imported_packages(path).items() if name in FORBIDDEN[package]]
    assert not offending, offending
