"""Fixtures for policy-server tests: checkpoints made by `trainer init-policy`, and
real `policy-server` processes on free ports (the vLLM one starts once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.supervisor import PolicyServerProcess
from trainer.cli import main as trainer_main

STATE_DIM, ACTION_DIM, CHUNK = 39, 4, 4
TASKS = ("reach-v3", "push-v3", "pick-place-v3")


def make_checkpoint(out: Path, **overrides: object) -> Path:
    args = ["init-policy", "--out", str(out), "--state-dim", str(STATE_DIM), "--action-dim", str(ACTION_DIM),
            "--tasks", ",".join(TASKS), "--chunk-size", str(CHUNK), "--init-std", "0.1", "--force"]
    for key, value in overrides.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    trainer_main(args)
    return out


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
