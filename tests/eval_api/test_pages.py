"""The HTML pages (``services/eval_api/pages``): the leaderboard, an evaluation, a policy.

Browser tests (marker ``browser``) serve the app with uvicorn on a free port against
a SQLite store the test seeds through the API and the store's own queries, load each
page in headless Chromium (Debian's, driven by Playwright), check rows, numbers and
plot elements, click to sort, watch live progress while the test finishes episodes,
and save a screenshot of each page under ``test-output/pages/``. The HTTP-level tests
(access rule, 404s, the schema) run on both store backends without a browser.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from PIL import Image
from sqlalchemy import select, update

from services.eval_api.pages import plots
from services.eval_api.pages import routes as pages_routes
from services.store import queries
from services.store.aggregates import wilson_interval
from services.store.db import create_db_engine
from services.store.models import Episode, Evaluation, utcnow
from services.supervisor import free_port
from tests.conftest import CHROMIUM
from tests.eval_api.conftest import MT10_TASKS, Api, make_api
from tests.eval_api.test_evaluations import play

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "pages"
WAIT_MS = 30_000  # upper bound for the browser to see a change (polls every 2 s); not a timing assertion


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def outcome(successes_per_task: int, per_task: int):
    """Finish kwargs: the first ``successes_per_task`` episodes of each task succeed; latencies vary."""
    def finish(episode: Episode) -> dict:
        i = episode.episode_index % per_task
        success = i < successes_per_task
        timeout = not success and episode.episode_index % 7 == 0
        return dict(success=success, steps=40 + 3 * i if success else 500, total_return=1.5 * i,
                    latency_mean_ms=8.0 + (episode.episode_index * 37 % 23), latency_p95_ms=30.0,
                    failure_reason="policy_timeout" if timeout else None)
    return finish


def finish_some(api: Api, evaluation_id: int, count: int | None = None) -> None:
    """Claim and finish (succeeded) the first ``count`` pending episodes; all of them and finalise if None."""
    with api.sessions() as session:
        pending = session.scalars(select(Episode).where(Episode.evaluation_id == evaluation_id,
                                                        Episode.status == "pending")
                                  .order_by(Episode.episode_index)).all()
        for episode in pending[:count]:
            assert queries.claim_episode(session, episode.id, "worker-ui", 60)
            queries.finish_episode(session, episode.id, success=True, steps=30, latency_mean_ms=12.0)
        if count is None:
            assert queries.finalize_evaluation_if_done(session, evaluation_id)


def seed(api: Api) -> dict[str, int]:
    """Three policies ranked on MT10 (100% of 30, 50% of 80 pooled from 25% and 75% of 40, 50% of 20), one also on MT1 reach, with
    finish dates spread over days so the policy page's line has a shape; returns the ids."""
    alpha = api.register_policy("alpha", "ws://alpha.test/ws")["id"]
    beta = api.register_policy("beta", "ws://beta.test/ws")["id"]
    gamma = api.register_policy("gamma", "ws://gamma.test/ws")["id"]
    ids = {"alpha": alpha, "beta": beta, "gamma": gamma}
    runs = [("alpha_early", alpha, {}, 1, 4), ("alpha_mt10", alpha, {}, 3, 4), ("beta_mt10", beta, {}, 3, 3),
            ("gamma_mt10", gamma, {}, 1, 2), ("alpha_reach_1", alpha, {"suite": "metaworld-mt1-reach"}, 5, 10),
            ("alpha_reach_2", alpha, {"suite": "metaworld-mt1-reach"}, 8, 10)]
    start = utcnow() - timedelta(days=len(runs))
    for day, (name, policy_id, body, successes, per_task) in enumerate(runs):
        evaluation_id = api.submit(policy_id, episodes_per_task=per_task, **body)["id"]
        play(api, evaluation_id, outcome(successes, per_task))
        with api.sessions() as session:
            session.execute(update(Evaluation).where(Evaluation.id == evaluation_id)
                            .values(finished_at=start + timedelta(days=day, hours=3)))
            session.commit()
        ids[name] = evaluation_id
    return ids


class ServedApp:
    """An app served by uvicorn in a thread on a free port, as a browser reaches it."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-pages", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServedApp:
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.05)
        assert self.server.started, "uvicorn did not start (see the log above)"
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def site(sqlite_url, chromium, tmp_path) -> Iterator[tuple[Api, ServedApp, object]]:
    """A seeded store, the app serving it, and a fresh browser page."""
    engine = create_db_engine(url=sqlite_url)
    apis = make_api(engine, artifact_root=tmp_path / "artifacts")
    api = next(apis)
    errors: list[str] = []
    with ServedApp(api.app) as served:
        context = chromium.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        yield api, served, page
        context.close()
    apis.close()
    engine.dispose()
    assert not errors, f"JavaScript errors on the page: {errors}"


def record_replay(api: Api, evaluation_id: int, episode_index: int) -> Path:
    """A small GIF where workers put replays, linked from the episode's row (as a worker would)."""
    relative = f"evaluations/{evaluation_id}/episode-{episode_index}.gif"
    path = api.app.state.settings.artifact_root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = [Image.new("RGB", (160, 120), colour) for colour in ((200, 40, 40), (40, 160, 60))]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=200, loop=0)
    with api.sessions() as session:
        session.execute(update(Episode).where(Episode.evaluation_id == evaluation_id,
                                              Episode.episode_index == episode_index)
                        .values(artifact_path=relative))
        session.commit()
    return path




def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    return path


def visible_policies(page) -> list[str]:
    return [name.split()[0] for name in page.eval_on_selector_all(
        "#leaderboard tbody tr", "rows => rows.filter(r => r.offsetParent !== null).map(r => r.cells[1].innerText)")]


def column(page, table: str, index: int) -> list[str]:
    return page.eval_on_selector_all(f"#{table} tbody tr", f"rows => rows.map(r => r.cells[{index}].innerText.trim())")


@pytest.mark.browser
def test_leaderboard_page_ranks_draws_intervals_and_sorts(site, monkeypatch):
    api, served, page = site
    ids = seed(api)
    monkeypatch.setattr(pages_routes, "LEADERBOARD_FIRST_ROWS", 2)  # as 100 of 1,000 rows: the rest wait hidden
    page.goto(served.url + "/")  # redirects to /ui/
    assert page.url == served.url + "/ui/"
    assert page.inner_text("#suite-name") == "metaworld-mt10"  # the suite ranking the most policies
    tabs = page.eval_on_selector_all(
        "#suites a", "as => as.map(a => [a.firstChild.textContent.trim(), a.querySelector('.count').textContent])")
    assert tabs == [["metaworld-mt1-reach", "1"], ["metaworld-mt10", "3"]]

    assert [name.split()[0] for name in column(page, "leaderboard", 1)] == ["beta", "alpha", "gamma"]
    assert column(page, "leaderboard", 2) == ["100.0%", "50.0%", "50.0%"]  # alpha's two evaluations pooled
    assert column(page, "leaderboard", 4) == ["30", "80", "20"]
    low, high = wilson_interval(40, 80)
    assert f"{pct(low)}–{pct(high)}" in column(page, "leaderboard", 3)[1]
    # The interval drawn in each row: alpha's bar covers 50% of its 160-px track, the whisker spans the
    # interval — as the browser computed the layers (left cap, right cap, whisker line, bar).
    assert page.locator("#leaderboard .interval-bar").count() == 3
    width, sizes, positions = page.eval_on_selector(
        "#leaderboard tbody tr:nth-child(2) .interval-bar",
        "s => [s.getBoundingClientRect().width, getComputedStyle(s).backgroundSize, "
        "getComputedStyle(s).backgroundPositionX]")
    layers = [layer.split() for layer in sizes.split(", ")]
    lefts = [float(x.removesuffix("px")) for x in positions.split(", ")[:3]]
    assert width == 160 and float(layers[3][0].removesuffix("px")) == pytest.approx(0.5 * 160, abs=0.1)
    assert float(layers[2][0].removesuffix("px")) == pytest.approx((high - low) * 160, abs=0.2)
    assert lefts == pytest.approx([low * 160 - 0.75, high * 160 - 0.75, low * 160], abs=0.2)
    assert page.get_attribute("#leaderboard tbody tr:nth-child(1) .policy a", "href") == f"/ui/policies/{ids['beta']}"
    screenshot(page, "leaderboard")

    assert page.locator("#leaderboard tbody.more").is_hidden() and visible_policies(page) == ["beta", "alpha"]

    # Sorting orders every row, hidden ones too, and keeps as many shown.
    page.click("#leaderboard th:has-text('Episodes')")
    assert column(page, "leaderboard", 4) == ["20", "30", "80"] and visible_policies(page) == ["gamma", "beta"]
    assert page.get_attribute("#leaderboard th:has-text('Episodes')", "aria-sort") == "ascending"
    page.click("#leaderboard th:has-text('Episodes')")
    assert column(page, "leaderboard", 4) == ["80", "30", "20"]
    page.click("#leaderboard th:has-text('Policy')")
    assert [name.split()[0] for name in column(page, "leaderboard", 1)] == ["alpha", "beta", "gamma"]
    page.click("#show-all")
    assert visible_policies(page) == ["alpha", "beta", "gamma"] and page.locator("#show-all").count() == 0

    page.click("#suites a:has-text('metaworld-mt1-reach')")
    page.wait_for_selector("#suite-name:has-text('metaworld-mt1-reach')")
    # Alpha's two reach evaluations pooled: 13 of 20.
    assert column(page, "leaderboard", 2) == ["65.0%"]


@pytest.mark.browser
def test_evaluation_page_shows_tasks_latency_and_episodes(site):
    api, served, page = site
    ids = seed(api)
    record_replay(api, ids["alpha_mt10"], 0)
    page.goto(f"{served.url}/ui/evaluations/{ids['alpha_mt10']}")
    assert page.inner_text("#status") == "finished"
    assert page.inner_text("#done") == "40 / 40"
    assert page.inner_text("#overall-rate") == "75.0%"
    low, high = wilson_interval(30, 40)
    assert page.inner_text("#overall-ci") == f"{pct(low)}–{pct(high)}"

    # Per-task bars with whiskers: 3 of 4 in each of the ten tasks.
    assert page.locator("#per-task rect.bar").count() == len(MT10_TASKS)
    assert page.locator("#per-task g.whisker").count() == len(MT10_TASKS)
    labels = page.eval_on_selector_all("#per-task text.row-label", "ts => ts.map(t => t.textContent)")
    assert labels == list(MT10_TASKS)
    task_low, task_high = wilson_interval(3, 4)
    values = page.eval_on_selector_all("#per-task text.row-value", "ts => ts.map(t => t.textContent)")
    assert values == [f"75.0% [{pct(task_low)}, {pct(task_high)}] n=4"] * len(MT10_TASKS)

    # Latency histogram: its bars count every episode that recorded a latency; p50/p95 markers.
    bars = page.eval_on_selector_all("#latency rect.hist-bar", "rs => rs.map(r => r.querySelector('title').textContent)")
    assert len(bars) >= 4 and sum(int(title.rsplit(": ", 1)[1]) for title in bars) == 40
    assert page.locator("#latency g.marker").count() == 2

    # Episodes table: one row per episode, in index order, with the recorded facts.
    assert page.locator("#episodes tbody tr").count() == 40
    assert column(page, "episodes", 1)[:5] == ["reach-v3"] * 4 + ["push-v3"]
    assert column(page, "episodes", 4)[:4] == ["yes", "yes", "yes", "no"]
    assert column(page, "episodes", 5)[:4] == ["40", "43", "46", "500"]
    reasons = column(page, "episodes", 8)
    with api.sessions() as session:
        timeouts = session.scalars(select(Episode.episode_index).where(
            Episode.evaluation_id == ids["alpha_mt10"], Episode.failure_reason == "policy_timeout")).all()
    assert timeouts and [i for i, r in enumerate(reasons) if r == "policy_timeout"] == sorted(timeouts)
    assert page.locator("#live-note").count() == 0  # finalised: nothing to poll
    # the first episode's replay GIF, loaded from ARTIFACT_ROOT
    assert page.locator("#episodes img.replay").count() == 1
    assert page.eval_on_selector("#episodes tbody tr:first-child img.replay", "i => i.naturalWidth") == 160
    screenshot(page, "evaluation")

    page.click("#episodes th:has-text('Steps')")
    page.click("#episodes th:has-text('Steps')")
    assert column(page, "episodes", 5)[0] == "500"


@pytest.mark.browser
def test_evaluation_page_follows_a_running_evaluation(site):
    api, served, page = site
    policy = api.register_policy("delta", "ws://delta.test/ws")
    evaluation_id = api.submit(policy["id"], episodes_per_task=1)["id"]
    page.goto(f"{served.url}/ui/evaluations/{evaluation_id}")
    assert page.inner_text("#done") == "0 / 10" and page.inner_text("#status") == "pending"
    assert page.locator("#live-note").count() == 1

    finish_some(api, evaluation_id, 4)
    page.wait_for_function("document.getElementById('done').textContent === '4 / 10'", timeout=WAIT_MS)
    assert page.inner_text("#status") == "running" and page.inner_text("#count-pending") == "6"
    assert page.inner_text("#overall-rate") == "100.0%"
    width = page.eval_on_selector("#progress .succeeded", "d => d.style.width")
    assert float(width.rstrip("%")) == pytest.approx(40)
    # The charts and the table are re-rendered in place once episodes have finished.
    page.wait_for_function("document.querySelectorAll('#per-task rect.bar').length === 4", timeout=WAIT_MS)
    assert page.inner_text("#overall-scored") == "4 / 4"
    assert column(page, "episodes", 3)[:5] == ["succeeded"] * 4 + ["pending"]
    assert page.locator("#latency rect.hist-bar").count() == 1  # four episodes of 12 ms
    screenshot(page, "evaluation-running")

    finish_some(api, evaluation_id)  # the rest, and finalise: the page reloads with the final figures
    page.wait_for_selector("#live-note", state="detached", timeout=WAIT_MS)
    page.wait_for_load_state()
    assert page.inner_text("#status") == "finished" and page.inner_text("#done") == "10 / 10"
    assert page.locator("#episodes tbody tr").count() == 10


@pytest.mark.browser
def test_policy_page_plots_success_per_suite_over_time(site):
    api, served, page = site
    ids = seed(api)
    page.goto(f"{served.url}/ui/policies/{ids['alpha']}")
    assert page.inner_text("h1").startswith("alpha")
    assert "ab" * 32 in page.inner_text("#metadata")
    series = page.eval_on_selector_all("#over-time path.series", "ps => ps.map(p => p.dataset.series)")
    assert series == ["metaworld-mt1-reach", "metaworld-mt10"]
    assert page.locator("#over-time circle.point").count() == 4
    assert page.locator("#over-time path.band").count() == 2
    # The MT10 line rises from 25% to 75%: its end is higher on screen (smaller y) than its start.
    d = page.get_attribute("#over-time path.series[data-series='metaworld-mt10']", "d")
    (_, y0), (_, y1) = (map(float, point.split(",")) for point in d.lstrip("M").split(" L"))
    assert y1 < y0
    assert column(page, "evaluations", 0) == [f"#{ids[k]}" for k in
                                              ("alpha_reach_2", "alpha_reach_1", "alpha_mt10", "alpha_early")]
    assert column(page, "evaluations", 3) == ["80.0%", "50.0%", "75.0%", "25.0%"]
    screenshot(page, "policy")

    page.click(f"#over-time a[href='/ui/evaluations/{ids['alpha_mt10']}']")
    page.wait_for_selector("#per-task")
    assert page.url.endswith(f"/ui/evaluations/{ids['alpha_mt10']}")


# ---------------------------------------------------------------------------- without a browser


def test_pages_answer_html_and_stay_out_of_the_schema(api):
    policy = api.register_policy()
    evaluation = api.submit(policy["id"], tasks=["reach-v3"], episodes_per_task=3)
    play(api, evaluation["id"], lambda e: dict(success=e.episode_index == 0, steps=9))
    root = api.client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/ui/"
    for path in ("/ui/", "/ui/?suite=", "/ui/?suite=metaworld-mt10&include_nonstandard=true",
                 f"/ui/evaluations/{evaluation['id']}",
                 f"/ui/policies/{policy['id']}"):
        response = api.client.get(path)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html"), path
        assert "<script src=" not in response.text and "<link" not in response.text  # nothing from elsewhere
    board = api.client.get("/ui/?suite=metaworld-mt10&include_nonstandard=true").text
    assert "33.3%" in board and f"/ui/evaluations/{evaluation['id']}" in board
    assert not [path for path in api.client.get("/openapi.json").json()["paths"] if path == "/" or "/ui" in path]
    assert api.client.get(f"/evaluations/{evaluation['id']}").headers["content-type"] == "application/json"


def test_unknown_ids_and_suites_are_html_404s_that_say_where_to_look(api):
    for path, words in (("/ui/evaluations/999", ["no evaluation with id 999", "GET /evaluations"]),
                        ("/ui/policies/999", ["no policy with id 999", "GET /policies"]),
                        ("/ui/?suite=metaworld-mt100", ["no suite named", "metaworld-mt100", "GET /suites"])):
        response = api.client.get(path)
        assert response.status_code == 404 and response.headers["content-type"].startswith("text/html"), path
        assert all(word.lower() in response.text.lower() for word in words), (path, response.text)


def test_pages_follow_the_read_key_rule(store_engine):
    for api in make_api(store_engine, reads_need_key=True):
        refused = api.client.get("/ui/")
        assert refused.status_code == 401 and refused.headers["content-type"].startswith("text/html")
        assert refused.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in refused.text and "EVALFORGE_READS_NEED_KEY" in refused.text
        assert api.client.get("/ui/", headers={"Authorization": "Bearer nope"}).status_code == 403
        assert api.client.get("/ui/", headers=api.auth).status_code == 200


def test_replays_are_served_from_the_artifact_root_only(store_engine, tmp_path):
    for api in make_api(store_engine, artifact_root=tmp_path / "artifacts"):
        policy = api.register_policy()
        evaluation = api.submit(policy["id"], tasks=["reach-v3"], episodes_per_task=3)
        play(api, evaluation["id"], lambda e: dict(success=True, steps=9))
        gif = record_replay(api, evaluation["id"], 1)
        with api.sessions() as session:
            ids = session.scalars(select(Episode.id).where(Episode.evaluation_id == evaluation["id"])
                                  .order_by(Episode.episode_index)).all()
            (tmp_path / "secret.gif").write_bytes(b"GIF89a secret")
            session.execute(update(Episode).where(Episode.id == ids[2]).values(artifact_path="../secret.gif"))
            session.commit()
        served = api.client.get(f"/ui/episodes/{ids[1]}/replay.gif")
        assert served.status_code == 200 and served.headers["content-type"] == "image/gif"
        assert served.content == gif.read_bytes()
        page = api.client.get(f"/ui/evaluations/{evaluation['id']}").text
        assert page.count('class="replay" src=') == 2  # the rows that record a replay (1 and 2)
        assert f"/ui/episodes/{ids[1]}/replay.gif" in page and f"/ui/episodes/{ids[0]}/replay.gif" not in page
        for episode_id, words in ((ids[0], "none recorded"), (ids[2], "../secret.gif"), (999, "none recorded")):
            missing = api.client.get(f"/ui/episodes/{episode_id}/replay.gif")
            assert missing.status_code == 404 and words in missing.text.replace("&#39;", "'"), episode_id
            assert "ARTIFACT_ROOT" in missing.text


def test_histogram_bins_cover_every_value_with_round_edges():
    values = [8.0 + (i * 37 % 23) for i in range(40)] + [50.0]
    edges, counts = plots.histogram_bins(values)
    assert sum(counts) == len(values) and len(edges) == len(counts) + 1
    assert edges[0] <= min(values) and edges[-1] > max(values)
    step = edges[1] - edges[0]
    assert step in (1, 2, 5, 10, 20) and all(edge % step == 0 for edge in edges)
    (low, high), counts = plots.histogram_bins([3.0, 3.0])
    assert low <= 3.0 < high and counts == [2]
    assert plots.histogram_bins([]) == ([], [])


def test_long_names_are_cut_with_an_ellipsis_and_kept_whole_in_the_title(api):
    name, version = "n" * 200, "v" * 100
    policy = api.register_policy(name=name)
    api.client.post("/policies", json={"name": name, "version": version, "endpoint": "ws://other.test:1/ws"},
                    headers=api.auth)
    page = api.client.get(f"/ui/policies/{policy['id']}").text
    assert f'<span class="clip" title="{name}">{name}</span>' in page
    css = page.split("<style>", 1)[1].split("</style>", 1)[0]
    assert ".clip {" in css and "text-overflow: ellipsis" in css and "max-width" in css
    assert "td.policy > a" in css  # the leaderboard's policy cells
