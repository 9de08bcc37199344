"""Simulator families: every suite names a known family, and the versions recorded are the installed ones."""

from __future__ import annotations

from importlib import metadata

import pytest

from benchmarks import simulators
from benchmarks.registry import get_suite, list_suites


def test_every_suite_belongs_to_a_known_family():
    families = {get_suite(name).simulator for name in list_suites()}
    assert families <= set(simulators.SIMULATOR_PACKAGES), families - set(simulators.SIMULATOR_PACKAGES)
    assert {"metaworld", "gym-pusht"} <= families


def test_versions_are_the_installed_packages():
    versions = simulators.simulator_versions("metaworld")
    assert versions == {"metaworld": metadata.version("metaworld"), "mujoco": metadata.version("mujoco")}
    assert simulators.is_available("metaworld")
    assert "metaworld" in simulators.available_simulators()


def test_an_unknown_family_is_refused():
    with pytest.raises(simulators.UnknownSimulator, match="known: metaworld"):
        simulators.simulator_versions("maniskill3")
