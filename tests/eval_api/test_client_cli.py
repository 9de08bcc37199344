"""The user CLI (``evalforge policy|eval|leaderboard``), its tables, and ``services.client`` against a served API.

The real app runs under uvicorn on a loopback port, on each store backend, with the
API fixtures' scripted policy handshake and recording queue (no broker, no policy
server). Episodes are finished with the store functions the workers call.
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from rich.console import Console

from services.cli import main
from services.cli.render import print_leaderboard, watch_with_progress
from services.client import ApiRequestError, ApiUnreachable, EvalForgeClient, WatchTimeout
from services.eval_api import schemas
from services.store import queries
from services.store.statuses import EvaluationStatus
from services.supervisor import free_port
from tests.eval_api.conftest import POLICY_ENDPOINT, Api, make_api, metadata
from tests.store.helpers import run_all

SUITE = "metaworld-mt10"
REPO = Path(__file__).resolve().parents[2]
GUARD_S = 60  # how long a helper waits for something that should happen at once before failing the test


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """``app`` under uvicorn in a thread on a free loopback port; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + GUARD_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(GUARD_S)
        sock.close()


@dataclass
class Served:
    api: Api
    url: str

    def client(self, **kwargs) -> EvalForgeClient:
        return EvalForgeClient(self.url, self.api.key, **kwargs)

    def finish(self, evaluation_id: int, succeed: int = 0) -> None:
        """Play every live episode as a worker would; the first ``succeed`` of them succeed."""
        with self.api.sessions() as session:
            ids = [e.id for e in queries.list_episodes(session, evaluation_id, limit=10_000)
                   if e.status in ("pending", "running")]
            run_all(session, ids, set(ids[:succeed]))
            queries.finalize_evaluation_if_done(session, evaluation_id)

    def polls_of(self, evaluation_id: int) -> float:
        """``GET /evaluations/{id}`` answered so far (the API's own request counter)."""
        return self.api.app.state.metrics.registry.get_sample_value(
            "evalforge_api_requests_total",
            {"method": "GET", "route": "/evaluations/{evaluation_id}", "status": "200"}) or 0.0


@pytest.fixture
def served(store_engine, monkeypatch) -> Iterator[Served]:
    for name in ("EVALFORGE_API_URL", "EVALFORGE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for api in make_api(store_engine):
        api.handshake.servers[POLICY_ENDPOINT] = metadata()
        with serve(api.app) as url:
            yield Served(api, url)


@pytest.fixture
def env(served, monkeypatch) -> Served:
    """The served API, with the CLI pointed at it through the environment."""
    monkeypatch.setenv("EVALFORGE_API_URL", served.url)
    monkeypatch.setenv("EVALFORGE_API_KEY", served.api.key)
    return served


def evalforge(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def evalforge_json(capsys, *argv: str):
    code, out, err = evalforge(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_register_submit_status_list_leaderboard(env, capsys):
    code, out, err = evalforge(capsys, "policy", "register", "--name", "bc", "--endpoint", POLICY_ENDPOINT,
                               "--version", "v1")
    assert code == 0, err
    assert out.startswith("policy 1: bc:v1 (checkpoint abababababab…)") and "10 tasks" in out
    again = evalforge_json(capsys, "policy", "register", "--name", "bc", "--endpoint", POLICY_ENDPOINT,
                           "--version", "v1")
    assert again["id"] == 1  # re-registering the same checkpoint is idempotent
    assert [p["id"] for p in evalforge_json(capsys, "policy", "list")] == [1]

    submitted = evalforge_json(capsys, "eval", "submit", "--policy", "bc", "--suite", SUITE,
                               "--episodes-per-task", "2", "--tag", "smoke", "--seed", "7")
    assert (submitted["status"], submitted["episodes_total"], submitted["tags"]) == ("pending", 20, ["smoke"])
    evaluation_id = submitted["id"]
    code, out, err = evalforge(capsys, "eval", "status", str(evaluation_id))
    assert code == 0, err
    assert f"evaluation {evaluation_id}: pending · policy bc:v1 (id 1)" in out and "0/20 episodes done" in out
    assert "overall" not in out  # no results table before the first episode ends

    env.finish(evaluation_id, succeed=15)
    detail = evalforge_json(capsys, "eval", "status", str(evaluation_id))
    assert detail["status"] == "finished" and detail["overall"]["succeeded"] == 15
    code, out, err = evalforge(capsys, "eval", "status", str(evaluation_id))
    assert code == 0, err
    assert "20/20 episodes done" in out
    assert "overall" in out and "75.0% (15/20)" in out and "[53.1, 88.8]" in out  # Wilson 95%, 15 of 20
    assert "reach-v3" in out and "window-close-v3" in out

    listed = evalforge_json(capsys, "eval", "list", "--policy", "bc:v1", "--tag", "smoke")
    assert [e["id"] for e in listed] == [evaluation_id]
    assert evalforge_json(capsys, "eval", "list", "--status", "running") == []
    code, out, _ = evalforge(capsys, "eval", "list", "--suite", SUITE)
    assert code == 0 and "bc:v1" in out and "finished" in out and "75.0%" in out

    board = evalforge_json(capsys, "leaderboard", "--suite", SUITE)
    assert [(e["rank"], e["policy"]["name"], e["evaluation_id"]) for e in board["entries"]] == [
        (1, "bc", evaluation_id)]
    code, out, err = evalforge(capsys, "leaderboard", "--suite", SUITE)
    assert code == 0, err
    assert "leaderboard · metaworld-mt10" in out and "75.0%" in out and "[53.1, 88.8]" in out and " v1 " in out


def test_status_watch_returns_when_the_episodes_are_done(served, capsys):
    client = served.client()
    policy = client.register_policy("bc", POLICY_ENDPOINT)
    evaluation_id = client.submit_evaluation(policy.id, SUITE, 1, tasks=["reach-v3", "push-v3"]).id
    with served.api.sessions() as session:
        episode_ids = [e.id for e in queries.list_episodes(session, evaluation_id)]
    problems: list[BaseException] = []

    def wait_for_polls(count: float) -> None:
        deadline = time.monotonic() + GUARD_S
        while served.polls_of(evaluation_id) < count:
            assert time.monotonic() < deadline, "the watch stopped polling"
            time.sleep(0.01)

    def worker() -> None:
        # Each episode finishes only after the watch has polled, and the watch must see every step:
        # a poll that started after a commit is two answers after the count read right after it.
        try:
            wait_for_polls(1)
            for index, episode_id in enumerate(episode_ids):
                with served.api.sessions() as session:
                    run_all(session, [episode_id], {episode_id} if index == 0 else set())
                    queries.finalize_evaluation_if_done(session, evaluation_id)
                if index < len(episode_ids) - 1:  # after the last one the watch stops polling
                    wait_for_polls(served.polls_of(evaluation_id) + 2)
        except BaseException as exc:  # reported by the test thread
            problems.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        code, out, err = evalforge(capsys, "eval", "status", str(evaluation_id), "--watch", "--poll", "0.02",
                                   "--api-url", served.url)
    finally:
        thread.join(GUARD_S)
    assert not problems, problems
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith(f"evaluation {evaluation_id}:")]
    assert lines[0].startswith(f"evaluation {evaluation_id}: 0/2 episodes done · pending")
    assert any(line.startswith(f"evaluation {evaluation_id}: 1/2 episodes done · running · success 1/1 (100.0%)")
               for line in lines), lines
    assert lines[-1].startswith(f"evaluation {evaluation_id}: 2/2 episodes done · finished · success 1/2 (50.0%)")
    assert "overall" in out and "50.0% (1/2)" in out


def test_watch_draws_a_progress_bar_on_a_terminal_and_can_give_up(served, capsys):
    client = served.client()
    policy = client.register_policy("bc", POLICY_ENDPOINT)
    evaluation_id = client.submit_evaluation(policy.id, SUITE, 2, tasks=["reach-v3"]).id

    with pytest.raises(WatchTimeout, match=f"evaluation {evaluation_id} is still pending after 0.05 s"):
        client.watch_evaluation(evaluation_id, poll_s=0.01, timeout_s=0.05)
    log = io.StringIO()
    with pytest.raises(WatchTimeout):
        watch_with_progress(client, evaluation_id, poll_s=0.01, timeout_s=0.05, console=Console(file=log))
    assert log.getvalue().startswith(f"evaluation {evaluation_id}: 0/2 episodes done · pending")
    code, _, err = evalforge(capsys, "eval", "status", str(evaluation_id), "--watch", "--watch-timeout", "0.05",
                             "--api-url", served.url)
    assert code == 1 and f"`evalforge eval status {evaluation_id} --watch`" in err

    served.finish(evaluation_id, succeed=2)
    screen = io.StringIO()
    final = watch_with_progress(client, evaluation_id, console=Console(file=screen, force_terminal=True, width=160,
                                                                       color_system=None))
    assert final.status == "finished" and final.done and final.episodes_done == 2
    assert f"evaluation {evaluation_id}" in screen.getvalue() and "2/2" in screen.getvalue()
    assert "success 2/2 (100.0%)" in screen.getvalue()
    client.close()


def test_unreachable_api_and_bad_url(capsys, monkeypatch):
    monkeypatch.delenv("EVALFORGE_API_URL", raising=False)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, err = evalforge(capsys, "eval", "list", "--api-url", url)
    assert code == 1 and out == ""
    assert f"cannot reach the EvalForge API at {url}" in err and "start it with `evalforge up`" in err
    assert "--api-url/EVALFORGE_API_URL" in err
    with EvalForgeClient(url) as client, pytest.raises(ApiUnreachable, match="not ready within 0.2 s"):
        client.wait_ready(0.2)

    code, _, err = evalforge(capsys, "leaderboard", "--suite", SUITE, "--api-url", "127.0.0.1:8080")
    assert code == 2 and "'127.0.0.1:8080' is not an http(s) URL" in err


def test_writes_without_a_valid_key_show_the_apis_message(served, capsys):
    code, _, err = evalforge(capsys, "policy", "register", "--name", "bc", "--endpoint", POLICY_ENDPOINT,
                             "--api-url", served.url)
    assert code == 1
    assert "this request needs an API key" in err and "(HTTP 401 unauthorized)" in err
    assert "pass --api-key KEY or set EVALFORGE_API_KEY" in err
    code, _, err = evalforge(capsys, "policy", "register", "--name", "bc", "--endpoint", POLICY_ENDPOINT,
                             "--api-url", served.url, "--api-key", "efk_not_a_key")
    assert code == 1 and "the API key is unknown or revoked" in err and "(HTTP 403 forbidden)" in err
    # Reads need no key on this server.
    code, out, err = evalforge(capsys, "policy", "list", "--api-url", served.url)
    assert code == 0 and "no policies registered" in out, err


def test_policy_references_that_do_not_resolve(env, capsys):
    code, _, err = evalforge(capsys, "eval", "submit", "--policy", "nobody", "--suite", SUITE,
                             "--episodes-per-task", "1")
    assert code == 1
    assert "no policy named 'nobody' is registered" in err and "evalforge policy register" in err

    code, _, err = evalforge(capsys, "eval", "submit", "--policy", "99", "--suite", SUITE, "--episodes-per-task", "1")
    assert code == 1 and "no policy with id 99" in err and "(HTTP 404 not_found)" in err

    env.api.handshake.servers["ws://other.test:8000/ws"] = metadata(sha="cd" * 32)
    for version, endpoint in (("v1", POLICY_ENDPOINT), ("v2", "ws://other.test:8000/ws")):
        assert main(["policy", "register", "--name", "bc", "--version", version, "--endpoint", endpoint]) == 0
    code, _, err = evalforge(capsys, "eval", "submit", "--policy", "bc", "--suite", SUITE, "--episodes-per-task", "1")
    assert code == 1 and "policy 'bc' has 2 versions" in err and "bc:v1 (id 1)" in err
    submitted = evalforge_json(capsys, "eval", "submit", "--policy", "bc:v2", "--suite", SUITE,
                               "--episodes-per-task", "1", "--task", "reach-v3")
    assert submitted["policy"]["version"] == "v2" and submitted["tasks"] == ["reach-v3"]

    # Another checkpoint under a taken name and version is the API's conflict, not a silent overwrite.
    code, _, err = evalforge(capsys, "policy", "register", "--name", "bc", "--version", "v1",
                             "--endpoint", "ws://other.test:8000/ws")
    assert code == 1 and "is already registered" in err and "policy_version_exists" in err


def test_client_pages_cancels_and_replays(served, capsys):
    with served.client(page_size=2) as client:
        client.wait_ready(GUARD_S)
        assert "metaworld-mt10" in {suite.name for suite in client.suites()}
        policy = client.register_policy("bc", POLICY_ENDPOINT)
        first = client.submit_evaluation(policy.id, SUITE, 5, tasks=["reach-v3"], seed=3,
                                         idempotency_key="run-1")
        assert client.submit_evaluation(policy.id, SUITE, 5, tasks=["reach-v3"], seed=3,
                                        idempotency_key="run-1").id == first.id
        episodes = client.episodes(first.id)  # three pages of two
        assert [e.episode_index for e in episodes] == [0, 1, 2, 3, 4]
        assert all(isinstance(e, schemas.EpisodeOut) and e.status == "pending" for e in episodes)
        later = [client.submit_evaluation(policy.id, SUITE, 1, tasks=["push-v3"]).id for _ in range(3)]
        assert [e.id for e in client.list_evaluations(limit=3)] == later[::-1]
        assert [e.id for e in client.list_evaluations(limit=None)] == [*later[::-1], first.id]
        with pytest.raises(TypeError, match="unknown filters"):
            client.list_evaluations(policy=1)
        with pytest.raises(ApiRequestError) as refused:
            client.submit_evaluation(policy.id, "metaworld-mt11", 1)
        assert (refused.value.status, refused.value.code) == (422, "unknown_suite")

    code, out, err = evalforge(capsys, "eval", "cancel", str(first.id), "--api-url", served.url,
                               "--api-key", served.api.key)
    assert code == 0 and f"evaluation {first.id} is cancelled: 5 episodes cancelled" in out, err
    code, _, err = evalforge(capsys, "eval", "cancel", str(later[0]), "--api-url", served.url)
    assert code == 1 and "needs an API key" in err


def test_bad_usage_exits_2(capsys):
    for argv in (["eval", "submit", "--policy", "bc", "--episodes-per-task", "1"],  # no --suite
                 ["eval", "submit", "--policy", "bc", "--suite", SUITE, "--episodes-per-task", "0"],
                 ["eval", "list", "--status", "done"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    assert "--episodes-per-task: must be at least 1, got 0" in capsys.readouterr().err


def test_the_client_returns_the_apis_response_bodies(served):
    """The client's answers are instances of the classes the API declares its responses with
    (services/eval_api/schemas.py), parsed from a served API's JSON: one definition, no copy."""
    with served.client() as client:
        policy = client.register_policy("bc", POLICY_ENDPOINT, version="v1")
        assert type(policy) is schemas.PolicyOut and policy.label == "bc:v1"
        assert type(client.get_policy(policy.id)) is schemas.PolicyOut
        assert [type(p) for p in client.list_policies()] == [schemas.PolicySummary]
        assert type(client.resolve_policy("bc:v1")) is schemas.PolicyOut

        submitted = client.submit_evaluation(policy.id, SUITE, 1, tasks=["reach-v3", "push-v3"])
        assert type(submitted) is schemas.EvaluationDetail and type(submitted.policy) is schemas.PolicyRef
        assert submitted.status is EvaluationStatus.PENDING and not submitted.done
        assert submitted.episodes_done == 0
        assert {type(e) for e in client.episodes(submitted.id)} == {schemas.EpisodeOut}
        served.finish(submitted.id, succeed=1)

        report = client.get_evaluation(submitted.id)
        assert type(report) is schemas.EvaluationDetail and report.done and report.episodes_done == 2
        assert type(report.overall) is schemas.Results and type(report.overall.ci95) is schemas.Interval
        assert {type(t) for t in report.per_task} == {schemas.TaskResults}
        assert [type(e) for e in client.list_evaluations()] == [schemas.EvaluationOut]

        board = client.leaderboard(SUITE, include_nonstandard=True)
        assert type(board) is schemas.LeaderboardOut
        assert [type(entry) for entry in board.entries] == [schemas.LeaderboardEntryOut]
        assert board.entries[0].policy.label == "bc:v1"
        suites = client.suites()
        assert suites and {type(suite) for suite in suites} == {schemas.SuiteOut}
        assert {type(task) for suite in suites for task in suite.tasks} == {schemas.SuiteTask}

        second = client.submit_evaluation(policy.id, SUITE, 1, tasks=["reach-v3"])
        cancelled = client.cancel_evaluation(second.id)
        assert type(cancelled) is schemas.EvaluationDetail and cancelled.done


@pytest.mark.parametrize("module", ["services.client", "services.eval_api.schemas"])
def test_the_client_and_the_response_bodies_import_neither_fastapi_nor_sqlalchemy(module):
    """Scripts and notebooks import the client without the server's stack (a fresh interpreter, so
    nothing this test process already imported hides an import)."""
    probe = (f"import sys, {module}; heavy = sorted({{'fastapi', 'sqlalchemy', 'starlette'}} & set(sys.modules)); "
             "assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                          timeout=GUARD_S)
    assert done.returncode == 0, f"importing {module} pulls {done.stderr.strip().splitlines()[-1:]}"


def test_json_output_is_the_apis_json(env, capsys):
    assert main(["policy", "register", "--name", "bc", "--endpoint", POLICY_ENDPOINT]) == 0
    submitted = evalforge_json(capsys, "eval", "submit", "--policy", "bc", "--suite", SUITE,
                               "--episodes-per-task", "1", "--task", "reach-v3")
    env.finish(submitted["id"], succeed=1)
    with httpx.Client(base_url=env.url) as http:
        assert evalforge_json(capsys, "eval", "status", str(submitted["id"])) == http.get(
            f"/evaluations/{submitted['id']}").json()
        assert evalforge_json(capsys, "policy", "list") == http.get("/policies").json()["items"]
        assert evalforge_json(capsys, "leaderboard", "--suite", SUITE, "--include-nonstandard") == http.get(
            "/leaderboard", params={"suite": SUITE, "include_nonstandard": "true"}).json()


def _long_board() -> schemas.LeaderboardOut:
    policy = {"id": 1, "name": "reach-behaviour-cloning-from-scripted-demonstrations", "version":
              "episodes-200-seed-7-lr-3e-4", "checkpoint_sha256": "ab" * 32}
    return schemas.LeaderboardOut.model_validate({"suite": "metaworld-mt1-reach", "include_nonstandard": True,
                                                  "definition_hash": "cd" * 32, "current_definition": True,
                                                  "entries": [
        {"rank": 1, "policy": policy, "evaluation_id": 12, "evaluation_ids": [12], "successes": 15,
         "not_different_from_above": False, "success_rate": 0.75,
         "ci95": {"low": 0.531, "high": 0.888}, "episodes": 20, "finished_at": "2026-12-01T19:55:00Z"}]})


def test_tables_written_to_a_pipe_or_file_are_not_cut():
    for console in (Console(file=io.StringIO()), Console(file=io.StringIO(), width=40)):  # not a terminal
        print_leaderboard(_long_board(), console)
        text = console.file.getvalue()
        assert "reach-behaviour-cloning-from-scripted-demonstrations" in text, text
        assert "episodes-200-seed-7-lr-3e-4" in text and "[53.1, 88.8]" in text and "2026-12-01 19:55" in text
        assert "…" not in text
    terminal = Console(file=io.StringIO(), force_terminal=True, width=80, color_system=None)
    print_leaderboard(_long_board(), terminal)  # a terminal's table fits the terminal
    assert max(len(line) for line in terminal.file.getvalue().splitlines()) <= 80


def test_the_leaderboard_verb_prints_full_names_to_a_pipe(env, capsys):
    name = "metaworld-mt10-behaviour-cloning-from-scripted-demonstrations"
    assert main(["policy", "register", "--name", name, "--version", "episodes-200-seed-7",
                 "--endpoint", POLICY_ENDPOINT]) == 0
    evaluation_id = evalforge_json(capsys, "eval", "submit", "--policy", name, "--suite", SUITE,
                                   "--episodes-per-task", "1")["id"]
    env.finish(evaluation_id, succeed=3)
    code, out, err = evalforge(capsys, "leaderboard", "--suite", SUITE)  # capsys: stdout is not a terminal
    assert code == 0, err
    assert name in out and "episodes-200-seed-7" in out and "…" not in out
    code, out, err = evalforge(capsys, "eval", "list")
    assert code == 0 and f"{name}:episodes-200-seed-7" in out and "…" not in out, err
