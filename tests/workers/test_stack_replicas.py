"""`evalforge up --replicas K`: K policy servers of one checkpoint on consecutive ports, registered as
one policy with K endpoints, whose episodes the workers spread over them."""

from __future__ import annotations

import argparse
import re
import socket
import urllib.request

from services.stack import build_specs, busy_ports, parse_checkpoints
from services.supervisor import free_port
from tests.workers.test_stack import UpProcess, _assert_finished, consecutive_free_ports


def _args(**overrides) -> argparse.Namespace:
    defaults = {"host": "127.0.0.1", "port": free_port(), "engine": "hf", "workers": 1, "concurrency": None}
    return argparse.Namespace(**{**defaults, **overrides})


def test_replicas_take_consecutive_ports_and_one_process_each(reach_checkpoint):
    checkpoints = parse_checkpoints([f"a={reach_checkpoint}", f"b={reach_checkpoint}"], 9000, replicas=3)
    assert [c.ports for c in checkpoints] == [[9000, 9001, 9002], [9003, 9004, 9005]]
    assert checkpoints[1].endpoints == [f"ws://127.0.0.1:{p}/ws" for p in (9003, 9004, 9005)]
    specs = {spec.name: spec for spec in build_specs(_args(), checkpoints)}
    policy = [name for name in specs if name.startswith("policy-")]
    assert policy == ["policy-1", "policy-1-2", "policy-1-3", "policy-2", "policy-2-2", "policy-2-3"]
    assert specs["policy-2-3"].health_url == "http://127.0.0.1:9005/readyz"
    argv = specs["policy-1-2"].argv
    assert argv[argv.index("--port") + 1] == "9001" and argv[argv.index("--name") + 1] == "a"


def test_a_taken_replica_port_is_named(reach_checkpoint, tmp_path):
    first = consecutive_free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first + 1))
        taken.listen()
        checkpoints = parse_checkpoints([str(reach_checkpoint)], first, replicas=2)
        problems = busy_ports(_args(), checkpoints)
    assert len(problems) == 1 and f"port {first + 1}" in problems[0] and "--policy-port (+1)" in problems[0]


def _infers(endpoint: str) -> int:
    port = int(re.search(r":(\d+)/", endpoint).group(1))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    match = re.search(r'^evalforge_policy_requests_total\{type="infer"\} ([0-9.e+]+)$', text, re.MULTILINE)
    return int(float(match.group(1))) if match else 0


def test_up_with_two_replicas_registers_one_policy_served_by_both(tmp_path, reach_checkpoint):
    up = UpProcess(tmp_path, reach_checkpoint, {"DATABASE_URL": f"sqlite:///{tmp_path / 'evalforge.db'}"},
                   replicas=2)
    try:
        state = up.wait_ready()
        entry = state["policies"][0]
        assert len(entry["endpoints"]) == 2 and entry["endpoint"] == entry["endpoints"][0]
        assert {"policy-1", "policy-1-2"} <= set(state["processes"])
        policy = up.client().get_policy(entry["id"])
        assert policy.endpoints == entry["endpoints"], "one policy with both servers"
        _assert_finished(up.evaluate(4), 4)
        assert all(_infers(endpoint) > 0 for endpoint in entry["endpoints"]), "episodes went to both replicas"
    finally:
        code = up.stop()
    assert code == 0, up.log()
