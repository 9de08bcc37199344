"""`evalforge up` and its supervisor, with real processes: the whole stack on the embedded
defaults (SQLite + the filesystem broker) and on PostgreSQL + Redis, a worker killed and
restarted, health-check restarts, and clean stops that leave no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.client import EvalForgeClient
from services.eval_api.schemas import EvaluationDetail
from services.stack import port_is_free
from services.supervisor import ChildProcess, ProcessSpec, Supervisor, free_port
from tests.workers.conftest import MAX_STEPS, REPO, SUITE, wait_for


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group ``pgid``."""
    return [pid for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
            if _safe_pgid(pid) == pgid and _alive(pid)]


def _safe_pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


# -- the supervisor, with small stand-in children ------------------------------------------------

def test_a_crashing_child_is_restarted_with_doubling_backoff(tmp_path):
    crash = ProcessSpec("crasher", [sys.executable, "-c", "import sys, time; time.sleep(0.2); sys.exit(3)"])
    steady = ProcessSpec("steady", [sys.executable, "-c", "import time; time.sleep(60)"])
    supervisor = Supervisor([crash, steady], tmp_path / "logs", backoff_start_s=0.2, backoff_max_s=0.8)
    supervisor.start_all()
    steady_pid = supervisor.children["steady"].pid
    try:
        wait_for(lambda: (supervisor.tick(), supervisor.children["crasher"].restarts >= 4)[1], 20,
                 "four restarts of the crashing child")
        crasher = supervisor.children["crasher"]
        assert crasher.last_exit == 3
        assert crasher.backoff_s == 0.8, "the back-off doubled up to its cap"
        assert supervisor.children["steady"].pid == steady_pid, "a sibling's crash leaves the others alone"
        log = (tmp_path / "logs" / "crasher.log").read_text()
        assert log.count("starting crasher") >= 4 and "(restart 3)" in log
    finally:
        codes = supervisor.stop_all(grace_s=5)
    assert not _alive(steady_pid) and codes["steady"] == -signal.SIGTERM


def test_an_unresponsive_child_is_killed_and_restarted(tmp_path):
    port = free_port()
    server = ProcessSpec("web", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                         health_url=f"http://127.0.0.1:{port}/", startup_timeout_s=30)
    supervisor = Supervisor([server], tmp_path / "logs", backoff_start_s=0.2, health_every_s=0.3,
                            unhealthy_after=2)
    supervisor.start_all()
    try:
        assert supervisor.wait_healthy(["web"], timeout_s=30)
        first = supervisor.children["web"].pid
        os.kill(first, signal.SIGSTOP)  # alive but answering nothing: only a health check can tell
        wait_for(lambda: (supervisor.tick(), supervisor.children["web"].restarts == 1)[1], 30,
                 "the frozen server to be restarted")
        assert not _alive(first)
        assert supervisor.wait_healthy(["web"], timeout_s=30)
        assert supervisor.children["web"].pid not in (None, first)
    finally:
        supervisor.stop_all(grace_s=5)


def test_stop_all_leaves_no_grandchild_behind(tmp_path):
    spec = ProcessSpec("family", ["bash", "-c", "sleep 300 & sleep 300 & wait"])
    supervisor = Supervisor([spec], tmp_path / "logs")
    supervisor.start_all()
    pgid = supervisor.children["family"].pid
    wait_for(lambda: len(_group_members(pgid)) >= 3, 10, "the grandchildren to start")
    supervisor.stop_all(grace_s=5)
    wait_for(lambda: not _group_members(pgid), 10, "the whole process group to be gone")


# -- `evalforge up` ------------------------------------------------------------------------------

def consecutive_free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 now, by the check ``evalforge up``
    makes: a kernel-picked free port + 1 may be held by another test's server (the replica-port
    failure CI saw)."""
    for _ in range(100):
        first = free_port()
        if all(port_is_free("127.0.0.1", port) for port in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports in 100 tries")


class UpProcess:
    """``evalforge up`` as a user runs it, on free ports, with its run directory under ``tmp_path``."""

    def __init__(self, tmp_path: Path, checkpoint: Path, env: dict[str, str], *extra: str, replicas: int = 1) -> None:
        self.run_dir = tmp_path / "stack"
        base = {k: v for k, v in os.environ.items()
                if k not in ("DATABASE_URL", "REDIS_URL", "EVALFORGE_BROKER_URL")}
        command = [sys.executable, "-m", "services.cli", "up", "--checkpoint", f"reach={checkpoint}",
                   "--engine", "hf", "--run-dir", str(self.run_dir), "--port", str(free_port()),
                   "--policy-port", str(consecutive_free_ports(replicas)), "--replicas", str(replicas),
                   "--concurrency", "1", "--grace", "15", *extra]
        # SIGTERM to its group reaches `evalforge up` alone (its children lead groups of their own),
        # which then stops them: as a user's Ctrl-C or `kill` does.
        self.process = ChildProcess(command, tmp_path / "up.log", env={**base, **env}, cwd=tmp_path,
                                    health=lambda: self.state().get("status") == "ready", grace_s=90,
                                    startup_timeout_s=240).start()

    def state(self) -> dict:
        path = self.run_dir / "stack.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def log(self) -> str:
        return self.process.log(5000)

    def wait_ready(self) -> dict:
        self.process.wait_healthy(poll_s=0.3)
        return self.state()

    def client(self) -> EvalForgeClient:
        state = self.state()
        return EvalForgeClient(state["api_url"], Path(state["api_key_file"]).read_text().strip())

    def evaluate(self, episodes: int = 2) -> EvaluationDetail:
        client = self.client()
        policy_id = self.state()["policies"][0]["id"]
        evaluation = client.submit_evaluation(policy_id, SUITE, episodes, max_steps=MAX_STEPS)
        return client.watch_evaluation(evaluation.id, poll_s=0.3, timeout_s=180)

    def stop(self) -> int:
        """Its exit status; -9 (and a failed assertion on it) if it did not stop within 90 s of SIGTERM."""
        return self.process.stop()


def _assert_finished(detail: EvaluationDetail, episodes: int) -> None:
    assert detail.status == "finished", detail
    assert detail.counts["succeeded"] + detail.counts["failed"] == episodes, detail.counts
    assert detail.overall.failure_reasons == {}, "every episode ran to its end"


def test_up_on_embedded_defaults_restarts_a_killed_worker_and_stops_cleanly(tmp_path, reach_checkpoint):
    up = UpProcess(tmp_path, reach_checkpoint, {"DATABASE_URL": f"sqlite:///{tmp_path / 'evalforge.db'}"})
    try:
        state = up.wait_ready()
        assert state["broker_url"].startswith("filesystem://"), "no REDIS_URL: the embedded broker"
        assert state["database_url"].startswith("sqlite:///")
        assert state["policies"][0]["id"] is not None, "the checkpoint was registered with the API"
        _assert_finished(up.evaluate(), 2)

        victim = state["processes"]["worker-1"]["pid"]
        os.killpg(victim, signal.SIGKILL)
        wait_for(lambda: up.state()["processes"]["worker-1"]["restarts"] == 1
                 and up.state()["processes"]["worker-1"]["pid"] not in (None, victim), 30,
                 "the supervisor to restart the killed worker")
        assert "worker-1 exited with code -9" in up.log()
        _assert_finished(up.evaluate(), 2)  # the new worker takes the next evaluation
        pids = [p["pid"] for p in up.state()["processes"].values()]
    finally:
        code = up.stop()
    assert code == 0, up.log()
    assert "evalforge up: stopped" in up.log()
    assert up.state()["status"] == "stopped"
    assert not any(_group_members(pid) for pid in pids if pid), "no process of the stack is left"


@pytest.mark.postgres
@pytest.mark.redis
def test_up_on_postgres_and_redis(tmp_path, reach_checkpoint, pg_database, redis_server, sessions):
    from services.store.models import Evaluation, EvaluationStatus

    up = UpProcess(tmp_path, reach_checkpoint, {"DATABASE_URL": pg_database, "REDIS_URL": redis_server.url})
    try:
        state = up.wait_ready()
        assert state["broker_url"] == redis_server.url and state["database_url"].startswith("postgresql")
        detail = up.evaluate()
        _assert_finished(detail, 2)
        with sessions() as session:  # the result is in PostgreSQL, not only in the API's answer
            assert session.get(Evaluation, detail.id).status == EvaluationStatus.FINISHED
        assert not (up.run_dir / "broker").exists(), "the embedded broker is not used when REDIS_URL is set"
    finally:
        code = up.stop()
    assert code == 0, up.log()


def test_up_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    result = subprocess.run([sys.executable, "-m", "services.cli", "up", "--checkpoint", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert f"--checkpoint {tmp_path}" in result.stderr and "policy.json" in result.stderr


def test_up_fails_at_once_naming_a_taken_port_and_its_flag(tmp_path):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--run-dir", str(tmp_path / "run"),
             "--workers", "0"], cwd=REPO, capture_output=True, text=True, timeout=60,
            env={**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'evalforge.db'}"})
    assert result.returncode == 2, result.stderr
    assert f"port {port}" in result.stderr and "--port" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "evalforge.db").exists(), "nothing was started"


def test_an_impostor_on_the_health_url_is_not_taken_for_the_child(tmp_path):
    """Something else answers 200 on the child's health URL: with an instance token the supervisor
    waits for the child's own answer; the real child echoing its token is healthy."""
    import http.server
    import threading
    import time

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b'{"status": "ok", "instance": "someone-else"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    impostor = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{impostor.server_address[1]}/healthz"
    port = free_port()
    echo = ("import http.server, json, os\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        body = json.dumps({'instance': os.environ['EVALFORGE_INSTANCE_TOKEN']}).encode()\n"
            "        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()\n"
            "        self.wfile.write(body)\n"
            f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    specs = [ProcessSpec("fake", [sys.executable, "-c", "import time; time.sleep(60)"], health_url=url,
                         instance_token=True),
             ProcessSpec("own", [sys.executable, "-c", echo], health_url=f"http://127.0.0.1:{port}/healthz",
                         instance_token=True),
             ProcessSpec("untokened", [sys.executable, "-c", "import time; time.sleep(60)"], health_url=url)]
    supervisor = Supervisor(specs, tmp_path / "logs", health_every_s=0.2)
    try:
        supervisor.start_all()
        assert supervisor.wait_healthy(["own", "untokened"], timeout_s=30)
        for _ in range(10):  # ten more rounds of checks: the impostor's 200 never counts
            supervisor.tick()
            time.sleep(0.25)
        assert not supervisor.children["fake"].healthy
        assert supervisor.children["own"].healthy and supervisor.children["untokened"].healthy
    finally:
        supervisor.stop_all(grace_s=2)
        impostor.shutdown()
