"""Fixtures for the policy-format tests: a real checkpoint (`trainer init-policy`) and the files of every version."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.policy_server.conftest import make_checkpoint

DATA = Path(__file__).parent / "data"
# policy.json files as the code of each format version wrote them (see data/README.md)
V1_PACKED = DATA / "policy-v1-packed.json"
V1_HAND_LAID = DATA / "policy-v1-hand-laid.json"
V2_CAMERAS = DATA / "policy-v2-cameras.json"
V2_STATE_ONLY = DATA / "policy-v2-state-only.json"
V3_VISION = DATA / "policy-v3-vision.json"
EVERY_VERSION = (V1_PACKED, V1_HAND_LAID, V2_CAMERAS, V2_STATE_ONLY, V3_VISION)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "policy-1m")
