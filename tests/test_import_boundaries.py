"""DESIGN.md's import arrows ("Top-level layout"): serving a policy needs no Python from `trainer`
(policy.json is the whole contract), `trainer` needs nothing of `services` (a command of both, like
`trainer rollout`, crosses as a process: `python -m services.workers.rollout`), `benchmarks/` stays
a leaf that both sides may import, and `services/protocol` is a leaf package a simulator's Python
environment installs alone. Checked on the source, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Every top-level package or module of this repository.
OURS = frozenset({p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and any(p.rglob("*.py"))} | {p.stem for p in REPO.glob("*.py")})

# directory → (modules of ours it must never import, exceptions); a module name covers its submodules
FORBIDDEN = {
    "services": ({"trainer"}, set()),
    "trainer": ({"services"}, set()),
    "benchmarks": ({"trainer", "services"}, set()),
    "services/protocol": (OURS, {"services.protocol"}),
    # The API and the workers meet only in the store and the queue contract
    # (services/episode_queue.py, services/broker.py), never in each other's code.
    "services/workers": ({"services.eval_api", "services.policy_server"}, set()),
    "services/eval_api": ({"services.workers", "services.policy_server"}, set()),
    "services/store": ({"services.eval_api", "services.workers", "services.policy_server"}, set()),
}

# The protocol's third-party dependencies (pyproject.toml [project] dependencies); the rest is stdlib.
PROTOCOL_DEPENDENCIES = {"msgpack", "numpy", "websockets"}


def imported_modules(path: Path) -> dict[str, int]:
    """Module imported → first line that imports it. ``from a.b import c`` counts as ``a.b.c`` (c may be
    a module); relative imports are resolved against ``path``'s package."""
    package = list(path.relative_to(REPO).parent.parts)
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            found.setdefault(name, node.lineno)
    return found


def covers(prefix: str, module: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_ours_names_the_packages_the_rules_name():
    assert {"trainer", "services", "benchmarks", "tests", "bench"} <= OURS


@pytest.mark.parametrize("directory", list(FORBIDDEN))
def test_package_does_not_import_what_design_forbids(directory):
    forbidden, allowed = FORBIDDEN[directory]
    files = sorted((REPO / directory).rglob("*.py"))
    assert files
    offending = [f"{path.relative_to(REPO)}:{line} imports {module}"
                 for path in files for module, line in imported_modules(path).items()
                 if any(covers(f, module) for f in forbidden) and not any(covers(a, module) for a in allowed)]
    assert not offending, f"DESIGN.md forbids these imports in {directory}/: {offending}"


def test_the_protocol_depends_on_msgpack_numpy_and_websockets_only():
    offending = [f"{path.relative_to(REPO)}:{line} imports {module}"
                 for path in sorted((REPO / "services/protocol").rglob("*.py"))
                 for module, line in imported_modules(path).items()
                 if module.split(".")[0] not in sys.stdlib_module_names | PROTOCOL_DEPENDENCIES | OURS]
    assert not offending, f"services/protocol may use only {sorted(PROTOCOL_DEPENDENCIES)} and the stdlib: {offending}"
