"""What speaking openpi's or vla-eval's protocol costs an episode, against our own, with one policy.

    .venv/bin/python bench/remote_protocols.py [--episodes 8] [--max-steps 150]

One numpy policy — MetaWorld reach's scripted expert, computed from the state, a chunk of
one action (closed loop) — behind three real servers, each in its own process:

- **evalforge**: our protocol, a minimal server written here with ``services.protocol``
  (metadata frame, ``infer`` → ``actions``), since ``policy-server`` serves checkpoints;
- **openpi**: openpi's own ``WebsocketPolicyServer`` (PyPI ``openpi-server``);
- **vla-eval**: a vla-eval ``PredictModelServer`` (PyPI ``vla-eval``) under ``serve_async``.

The workers' own episode path plays the same MetaWorld reach episodes on the same
evaluation seeds against each: ``make_client(protocol, url)`` + ``ActionChunkBroker`` +
``observing_policy`` (instruction for the other protocols) + ``run_policy_episode``. The
paths take turns seed by seed, so a change in a shared machine's load hits all alike.
Prints per-episode wall time, ms per step and per round trip, and the overhead against
evalforge (target: within 5%), with the per-seed ratios' median and range.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.registry import get_suite  # noqa: E402
from benchmarks.runner import run_policy_episode  # noqa: E402
from benchmarks.suite import evaluation_seed  # noqa: E402
from services.protocol.adapters import make_client  # noqa: E402
from services.protocol.client import ActionChunkBroker, ClientSettings  # noqa: E402
from services.supervisor import free_port  # noqa: E402
from services.workers.cameras import observing_policy  # noqa: E402

SUITE, TASK = "metaworld-mt1-reach", "reach-v3"
PROTOCOLS = ("evalforge", "openpi", "vla-eval")


def _expert():
    suite = get_suite(SUITE)
    expert = suite.expert(TASK)
    return lambda state: np.asarray(expert({"state": np.asarray(state, np.float32), "task": TASK}), np.float32)


def serve(protocol: str, port: int) -> None:
    """Run one server (in a child process) until killed."""
    act = _expert()
    if protocol == "openpi":
        from openpi_client.base_policy import BasePolicy
        from openpi_server.websocket_policy_server import WebsocketPolicyServer

        class Expert(BasePolicy):
            def infer(self, obs: dict) -> dict:
                return {"actions": act(obs["observation/state"])}

        WebsocketPolicyServer(Expert(), host="127.0.0.1", port=port, metadata={"action_dim": 4}).serve_forever()
    elif protocol == "vla-eval":
        from vla_eval.model_servers.predict import PredictModelServer
        from vla_eval.model_servers.serve import serve_async

        class Expert(PredictModelServer):
            def predict(self, obs: dict, ctx: object) -> dict:
                return {"actions": act(obs["state"])}

        asyncio.run(serve_async(Expert(), "127.0.0.1", port))
    else:
        from websockets.asyncio.server import serve as ws_serve

        from services.protocol.codec import packb, unpackb
        from services.protocol.messages import ActionsReply, Metadata, parse_request

        meta = Metadata(policy_name="reach-expert", checkpoint_sha256="0" * 64, state_dim=39, action_dim=4,
                        chunk_size=1, tasks=(TASK,)).to_wire()

        async def handler(ws) -> None:
            await ws.send(packb(meta))
            async for frame in ws:
                request = parse_request(unpackb(frame))
                actions = act(request.obs.state)[None, :]
                await ws.send(packb(ActionsReply(request.request_id, actions).to_wire()))

        async def main() -> None:
            async with ws_serve(handler, "127.0.0.1", port, compression=None):
                await asyncio.Future()

        asyncio.run(main())


def _wait_listening(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"no server came up on port {port}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8, help="episodes per protocol (default: 8)")
    parser.add_argument("--max-steps", type=int, default=150, help="step limit per episode (default: 150)")
    parser.add_argument("--serve", nargs=2, metavar=("PROTOCOL", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0

    ports = {protocol: free_port() for protocol in PROTOCOLS}
    children = [subprocess.Popen([sys.executable, __file__, "--serve", protocol, str(port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for protocol, port in ports.items()]
    try:
        for port in ports.values():
            _wait_listening(port)
        walls, steps, calls = _measure(ports, args.episodes, args.max_steps)
    finally:
        for child in children:
            child.kill()
            child.wait()

    print(f"MetaWorld {TASK}, {args.episodes} episodes per protocol on the same seeds, reach expert as a "
          f"numpy policy (chunk of 1); {platform.node()}, {platform.machine()}, {platform.python_version()}")
    print(f"{'protocol':<10} {'episode s':>9} {'steps':>6} {'ms/step':>8} {'round trip ms':>13} "
          f"{'vs evalforge':>12} {'per-seed ratio: median [min, max]':>35}")
    base = walls["evalforge"]
    for protocol in PROTOCOLS:
        wall = sum(walls[protocol])
        ratios = [w / b for w, b in zip(walls[protocol], base, strict=True)]
        print(f"{protocol:<10} {wall / args.episodes:>9.3f} {steps[protocol]:>6} "
              f"{1e3 * wall / steps[protocol]:>8.2f} {1e3 * statistics.median(calls[protocol]):>13.2f} "
              f"{wall / sum(base):>11.3f}× {statistics.median(ratios):>22.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    if len(set(steps.values())) != 1:
        print(f"warning: the protocols played different step counts {steps}: not the same policy", file=sys.stderr)
    return 0


def _measure(ports: dict[str, int], episodes: int, max_steps: int):
    suite = get_suite(SUITE)
    settings = ClientSettings(connect_deadline_s=30, call_timeout_s=30)
    clients = {p: make_client(p, f"ws://127.0.0.1:{port}", settings) for p, port in ports.items()}
    walls = {p: [] for p in PROTOCOLS}
    steps = dict.fromkeys(PROTOCOLS, 0)
    calls = {p: [] for p in PROTOCOLS}
    with suite.make_env(TASK, evaluation_seed(0)) as env:
        env.max_steps = max_steps
        for i in range(-1, episodes):  # -1: an untimed warm-up of every path
            seed = evaluation_seed(10_000 if i < 0 else i)
            for protocol in PROTOCOLS:
                broker = ActionChunkBroker(clients[protocol], episode_id=f"bench-{protocol}-{seed}")
                task_text = None if protocol == "evalforge" else suite.instruction(TASK)
                started = time.perf_counter()
                outcome = run_policy_episode(env, observing_policy(env, broker, None, task_text=task_text),
                                             seed=seed)
                wall = time.perf_counter() - started
                if i >= 0:
                    walls[protocol].append(wall)
                    steps[protocol] += outcome.steps
                    calls[protocol].extend(broker.latencies_s)
    for client in clients.values():
        client.close()
    return walls, steps, calls


if __name__ == "__main__":
    raise SystemExit(main())
