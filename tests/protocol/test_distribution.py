"""The protocol as a distribution of its own: ``pip install ./services/protocol`` into a fresh virtual
environment (no EvalForge, nothing but the package and what it declares), then its clients, run
there, against a real ``policy-server`` started from this environment.

What the fresh environment holds is what the package declares, so an import of anything outside
the package and msgpack, numpy and websockets fails there; the script also checks that no module
was loaded from outside the environment (the repository included)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.supervisor import PolicyServerProcess

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "services" / "protocol"
DEPENDENCIES = {"msgpack", "numpy", "websockets"}

pytestmark = pytest.mark.slow

# Runs in the fresh environment with `python -I` (no PYTHONPATH, no current directory on sys.path).
CLIENT_SCRIPT = textwrap.dedent("""
    import sys

    at_start = set(sys.modules)  # what the interpreter and site (.pth hooks) loaded before ours

    import asyncio, importlib, json, pkgutil

    import numpy as np

    import services.protocol
    from services.protocol.client import ActionChunkBroker, AsyncPolicyClient, PolicyClient

    # Every module of the package, not only those the client needs.
    modules = [m.name for m in pkgutil.walk_packages(services.protocol.__path__, "services.protocol.")]
    for name in modules:
        importlib.import_module(name)

    url = sys.argv[1]
    with PolicyClient(url) as client:
        meta = client.metadata
        obs = {"state": np.zeros(meta.state_dim, np.float32), "task": meta.tasks[0]}
        reply = client.infer(obs)
        broker = ActionChunkBroker(client, episode_id="fresh-venv")
        steps = [broker.act(obs) for _ in range(meta.chunk_size + 1)]
        client.ping()

    async def infer_async():
        async with AsyncPolicyClient(url) as client:
            replies = await asyncio.gather(*(client.infer(obs, step=i) for i in range(3)))
            return [r.actions.shape for r in replies]

    async_shapes = asyncio.run(infer_async())
    files = {name: getattr(module, "__file__", None) for name, module in sys.modules.items() if name not in at_start}
    print(json.dumps({
        "package_file": services.protocol.__file__,
        "modules": modules,
        "shape": list(reply.actions.shape),
        "dims": [meta.chunk_size, meta.action_dim],
        "broker_inferences": broker.inferences,
        "broker_action": list(steps[-1].shape),
        "async_shapes": [list(s) for s in async_shapes],
        "loaded_from": sorted({f for f in files.values() if f and not f.startswith((sys.prefix, sys.base_prefix))}),
        "top_level": sorted({name.split(".")[0] for name, f in files.items()
                             if f and "site-packages" in f}),
    }))
""")


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A virtual environment with ``pip install`` of the protocol package and nothing else of ours."""
    root = tmp_path_factory.mktemp("protocol-dist")
    # A copy of the package directory, so that the build leaves nothing (build/, *.egg-info) in the repository.
    source = root / "protocol"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", "*.so"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", str(source)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, f"pip install ./services/protocol failed:\n{install.stdout}\n{install.stderr}"
    return python


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    from trainer.cli import main as trainer_main

    checkpoint = tmp_path_factory.mktemp("ckpt") / "policy"
    trainer_main(["init-policy", "--suite", "metaworld-mt1-reach", "--out", str(checkpoint), "--force"])
    server = PolicyServerProcess(checkpoint, "--engine", "hf", log_dir=checkpoint.parent).start(240)
    yield server
    server.stop()


def test_the_distribution_declares_only_the_three_dependencies(fresh_venv):
    listed = subprocess.run([str(fresh_venv), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    installed = {p["name"].lower() for p in json.loads(listed)} - {"pip", "setuptools", "wheel"}
    assert installed == {"evalforge-protocol", *DEPENDENCIES}


def test_its_client_runs_against_a_policy_server_from_a_fresh_environment(fresh_venv, policy_server, tmp_path):
    result = subprocess.run([str(fresh_venv), "-I", "-c", CLIENT_SCRIPT, policy_server.ws_url], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"the client failed in the fresh environment:\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    venv_prefix = str(fresh_venv.parent.parent)
    assert report["package_file"].startswith(venv_prefix), "imported the installed package, not the repository's"
    assert {"services.protocol.client", "services.protocol.codec", "services.protocol.messages"} <= set(
        report["modules"])
    assert report["loaded_from"] == [], f"modules loaded from outside the environment: {report['loaded_from']}"
    assert set(report["top_level"]) <= {"services", *DEPENDENCIES}, report["top_level"]
    assert report["shape"] == report["dims"]
    assert report["broker_inferences"] == 2 and len(report["broker_action"]) == 1
    assert report["async_shapes"] == [report["dims"]] * 3
