"""DESIGN.md's import arrows ("Top-level layout"): serving a policy needs no Python from `trainer`
(policy.json is the contract, implemented once in the `policy_format/` leaf that both sides import),
`trainer` needs nothing of `services` (a command of both, like `trainer rollout`, crosses as a
process), `benchmarks/` stays a leaf that both sides may import, `services/protocol` is a leaf
distribution a simulator's Python environment installs alone, and the queue contract
(`services/queue.py`) and the process supervisor (`services/supervisor.py`) import nothing of the
services they serve. Checked on the source, so a lazy import inside a function counts too."""

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
    "benchmarks": ({"trainer", "services", "policy_format"}, set()),
    "policy_format": (OURS, {"policy_format"}),
    # The LeRobot v3 dataset format, once: the trainer trains on it, the workers record rollouts into it.
    "lerobot_format": (OURS, {"lerobot_format"}),
    "services/protocol": (OURS, {"services.protocol"}),
    "services/policy_server": (OURS, {"services.policy_server", "services.protocol", "policy_format"}),
    # The API and the workers meet only in the store and the queue contract (services/queue.py),
    # never in each other's code.
    "services/workers": ({"services.eval_api", "services.policy_server", "services.cli", "trainer",
                          "policy_format"}, set()),
    "services/eval_api": ({"services.workers", "services.policy_server", "services.cli", "trainer",
                           "policy_format"}, set()),
    "services/store": (OURS, {"services.store"}),
    "services/queue.py": (OURS, set()),
    "services/supervisor.py": (OURS, set()),
    # The HTTP client is only the client: the terminal rendering lives with the CLI. Its answers are the
    # API's response bodies, which import only the status enums (no FastAPI, no SQLAlchemy).
    "services/client.py": (OURS, {"services.eval_api.schemas", "services.store.statuses"}),
    "services/eval_api/schemas.py": (OURS, {"services.store.statuses"}),
    "services/store/statuses.py": (OURS, set()),
}

# The leaves' third-party dependencies (their pyproject.toml dependencies); the rest is stdlib.
PROTOCOL_DEPENDENCIES = {"msgpack", "numpy", "websockets"}
POLICY_FORMAT_DEPENDENCIES = {"numpy"}
LEROBOT_FORMAT_DEPENDENCIES = {"numpy", "pyarrow", "av"}


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
    root = REPO / directory
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    assert files
    offending = [f"{path.relative_to(REPO)}:{line} imports {module}"
                 for path in files for module, line in imported_modules(path).items()
                 if any(covers(f, module) for f in forbidden) and not any(covers(a, module) for a in allowed)]
    assert not offending, f"DESIGN.md forbids these imports in {directory}/: {offending}"


@pytest.mark.parametrize(("directory", "dependencies"), [("services/protocol", PROTOCOL_DEPENDENCIES),
                                                         ("policy_format", POLICY_FORMAT_DEPENDENCIES),
                                                         ("lerobot_format", LEROBOT_FORMAT_DEPENDENCIES)])
def test_a_leaf_uses_only_its_declared_dependencies(directory, dependencies):
    offending = [f"{path.relative_to(REPO)}:{line} imports {module}"
                 for path in sorted((REPO / directory).rglob("*.py"))
                 for module, line in imported_modules(path).items()
                 if module.split(".")[0] not in sys.stdlib_module_names | dependencies | OURS]
    assert not offending, f"{directory} may use only {sorted(dependencies)} and the stdlib: {offending}"


# The peers EvalForge interoperates with (issue 18) are test dependencies only: services speak their
# protocols from their own code (services/protocol/openpi.py, vla_eval.py), never through their packages.
PEER_PACKAGES = {"vla_eval", "openpi", "openpi_client", "openpi_server"}


def test_services_never_import_the_peers_they_speak_to():
    offending = [f"{path.relative_to(REPO)}:{line} imports {module}"
                 for path in sorted((REPO / "services").rglob("*.py"))
                 for module, line in imported_modules(path).items()
                 if module.split(".")[0] in PEER_PACKAGES]
    assert not offending, f"services/ speaks openpi's and vla-eval's protocols without their packages: {offending}"


@pytest.mark.parametrize("gone", ["trainer/policy_file.py", "services/policy_server/policy_format.py",
                                  "services/broker.py", "services/episode_queue.py", "services/client_cli.py",
                                  "services/protocol/launcher.py", "services/protocol/_speedups.c", "setup.py"])
def test_what_now_lives_in_one_place_is_not_left_behind(gone):
    assert not (REPO / gone).exists(), f"{gone} was consolidated (issue 15); its one home is named in DESIGN.md"


def test_the_layout_design_md_names_exists():
    for path in ("policy_format/__init__.py", "lerobot_format/__init__.py", "services/protocol/pyproject.toml", "services/queue.py",
                 "services/supervisor.py", "services/cli/__init__.py"):
        assert (REPO / path).is_file(), path


def test_the_http_client_draws_nothing():
    used = {module.split(".")[0] for module in imported_modules(REPO / "services/client.py")}
    assert not used & {"rich", "fastapi", "sqlalchemy"}, "services/client.py is the client only (DESIGN.md)"
