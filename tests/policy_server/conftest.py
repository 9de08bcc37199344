"""Fixtures for policy-server tests: checkpoints made by `trainer init-policy`, and
real `policy-server` processes on free ports (the vLLM one starts once per session)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from websockets.sync.client import connect

from services.protocol.codec import packb, unpackb
from services.protocol.messages import Metadata
from services.supervisor import PolicyServerProcess
from trainer.cli import main as trainer_main

STATE_DIM, ACTION_DIM, CHUNK = 39, 4, 4
TASKS = ("reach-v3", "push-v3", "pick-place-v3")
CAMERAS = {"corner": (224, 224), "gripper": (224, 224)}
"""What ``camera_checkpoint`` declares: a 4-camera observation at this size is the issue's frame-cap case."""


def make_checkpoint(out: Path, **overrides: object) -> Path:
    args = ["init-policy", "--out", str(out), "--state-dim", str(STATE_DIM), "--action-dim", str(ACTION_DIM),
            "--tasks", ",".join(TASKS), "--chunk-size", str(CHUNK), "--init-std", "0.1", "--force"]
    for key, value in overrides.items():
        args += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])  # True: a bare flag
    trainer_main(args)
    return out


def random_state(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, STATE_DIM).astype(np.float32)


def camera_images(seed: int = 0, cameras: dict[str, tuple[int, int]] = CAMERAS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for name, (h, w) in cameras.items()}


class RawConnection:
    """A bare WebSocket to send frames no well-behaved client would."""

    def __init__(self, url: str) -> None:
        self.ws = connect(url, proxy=None, max_size=None, legacy=True)
        self.metadata = Metadata.from_wire(unpackb(self.ws.recv(timeout=30)))

    def ask(self, frame: bytes | str) -> dict:
        self.ws.send(frame)
        return unpackb(self.ws.recv(timeout=30))

    def infer(self, request_id: int = 1, **obs_changes) -> dict:
        obs = {"state": random_state(request_id), "task": "reach-v3", **obs_changes}
        return self.ask(packb({"type": "infer", "request_id": request_id, "obs": obs}))

    def close(self) -> None:
        self.ws.close()


def start_server(checkpoint: Path, log_dir: Path, *args: str, timeout: float = 240) -> PolicyServerProcess:
    """Start `policy-server` (logging into ``log_dir``) and wait until /readyz says ready."""
    return PolicyServerProcess(checkpoint, *args, log_dir=log_dir).start(timeout)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "policy-1m")


@pytest.fixture(scope="session")
def vllm_server(checkpoint, tmp_path_factory):
    server = start_server(checkpoint, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_server(checkpoint, tmp_path_factory):
    server = start_server(checkpoint, tmp_path_factory.mktemp("logs"), "--engine", "hf",
                          "--max-frame-bytes", str(1 << 20))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def camera_checkpoint(tmp_path_factory) -> Path:
    """A random-init policy whose card declares ``CAMERAS`` (`trainer init-policy --cameras ... --image-size`)."""
    (height, width), = set(CAMERAS.values())
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "policy-cameras", cameras=",".join(CAMERAS),
                           image_size=f"{height}x{width}")


@pytest.fixture(scope="session")
def camera_server(camera_checkpoint, tmp_path_factory):
    """The transformers engine serving ``camera_checkpoint`` with the default frame cap."""
    server = start_server(camera_checkpoint, tmp_path_factory.mktemp("logs"), "--engine", "hf")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference(checkpoint):
    """The transformers engine, in-process: the answer every server must give."""
    import asyncio

    from policy_format import load_checkpoint
    from services.policy_server.engines import HfEngine

    policy = load_checkpoint(checkpoint)
    engine = HfEngine(policy)
    asyncio.run(engine.start())

    def actions_for(state, task):
        return policy.tokenizer.decode_actions(engine.generate_sync(policy.tokenizer.prompt(task, state)))

    return actions_for
