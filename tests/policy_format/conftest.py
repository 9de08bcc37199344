"""Fixtures for the policy-format tests: a real checkpoint (`trainer init-policy`) and the v1 files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.policy_server.conftest import make_checkpoint

DATA = Path(__file__).parent / "data"
# policy.json files as the code of each format version wrote them (see data/README.md)
V1_PACKED = DATA / "policy-v1-packed.json"
V1_HAND_LAID = DATA / "policy-v1-hand-laid.json"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "policy-1m")
