"""Cameras in the API: a policy's handshake names the cameras it asks for, an evaluation records the
cameras its workers render (the policy's, or the request's), checked against the suite's catalogue."""

from __future__ import annotations

from sqlalchemy import text

from benchmarks.registry import get_suite
from services.store.models import Evaluation

PIXELS = "metaworld-mt10-pixels"
VISION = {"corner": (96, 96), "gripper": (96, 96)}


def _vision_policy(api, cameras=VISION, name="vision") -> dict:
    return api.register_policy(name, f"ws://{name}.test/ws", state_dim=36, cameras=cameras)


def test_the_catalogue_lists_each_suites_cameras_and_exposed_state(api):
    suites = {s["name"]: s for s in api.client.get("/suites", headers=api.auth).json()}
    pixels, state = suites[PIXELS], suites["metaworld-mt10"]
    assert {c["name"] for c in pixels["cameras"]} >= {"corner", "gripper"}
    assert all(c["height"] >= 16 and c["width"] >= 16 for c in pixels["cameras"])
    assert pixels["state_dim"] == len(pixels["state_names"]) == 36
    assert not any(name.startswith("goal_") for name in pixels["state_names"])
    assert state["state_dim"] == 39 and "goal_x" in state["state_names"]
    assert suites["pusht"]["cameras"][0]["name"] == "top"
    assert pixels["overview_camera"] == get_suite(PIXELS).overview_camera


def test_a_registered_policy_keeps_the_cameras_its_server_asks_for(api):
    policy = _vision_policy(api)
    assert policy["cameras"] == {"corner": [96, 96], "gripper": [96, 96]}
    assert api.client.get(f"/policies/{policy['id']}", headers=api.auth).json()["cameras"] == policy["cameras"]
    listed = api.client.get("/policies", headers=api.auth).json()["items"]
    assert listed[0]["cameras"] == policy["cameras"]
    assert api.register_policy("state-only")["cameras"] == {}


def test_an_evaluation_renders_the_policys_cameras_by_default_and_records_them(api):
    policy = _vision_policy(api)
    body = api.submit(policy["id"], suite=PIXELS)
    assert body["cameras"] == {"corner": [96, 96], "gripper": [96, 96]}
    with api.sessions() as session:
        assert session.get(Evaluation, body["id"]).cameras == body["cameras"]
    page = api.client.get(f"/ui/evaluations/{body['id']}", headers=api.auth)
    assert "corner</b> (96×96)" in page.text and "gripper</b> (96×96)" in page.text


def test_a_state_only_policy_renders_nothing_unless_the_request_asks(api):
    policy = api.register_policy("state-only", state_dim=36)
    assert api.submit(policy["id"], suite=PIXELS)["cameras"] == {}
    asked = api.submit(policy["id"], suite=PIXELS, cameras={"corner": [128, 160]})
    assert asked["cameras"] == {"corner": [128, 160]}
    page = api.client.get(f"/ui/evaluations/{asked['id'] - 1}", headers=api.auth)
    assert "State only" in page.text


def test_cameras_the_suite_lacks_or_the_policy_cannot_take_are_422(api):
    policy = _vision_policy(api)
    error = api.submit(policy["id"], suite=PIXELS, expect=422, cameras={**VISION, "wrist": [96, 96]})["error"]
    assert error["code"] == "unknown_camera" and "'wrist'" in error["message"] and "corner" in error["message"]
    error = api.submit(policy["id"], suite=PIXELS, expect=422, cameras={"corner": [64, 64]})["error"]
    assert error["code"] == "incompatible_policy" and "corner at 96×96" in error["message"]
    assert "gripper at 96×96" in error["message"]
    error = api.submit(policy["id"], suite=PIXELS, expect=422, cameras={})["error"]
    assert error["code"] == "incompatible_policy"
    # An override may add a camera the policy does not ask for.
    assert api.submit(policy["id"], suite=PIXELS, cameras={**VISION, "corner": [96, 96]})["cameras"] == \
        {"corner": [96, 96], "gripper": [96, 96]}
    state = api.register_policy("pusht", "ws://pusht.test/ws", tasks=("push-t",), state_dim=5, action_dim=2)
    error = api.submit(state["id"], suite="pusht", expect=422, cameras={"corner": [96, 96]})["error"]
    assert error["code"] == "unknown_camera" and "top" in error["message"]


def test_bad_camera_sizes_are_refused_by_the_schema(api):
    policy = api.register_policy("state-only", state_dim=36)
    for cameras in ({"corner": [8, 96]}, {"corner": [96]}, {"corner": [96, 4096]}, {"bad name!": [96, 96]}):
        api.submit(policy["id"], suite=PIXELS, expect=422, cameras=cameras)


def test_rows_from_before_cameras_were_recorded_read_as_state_only(api):
    policy = api.register_policy("old")
    body = api.submit(policy["id"])
    with api.sessions() as session:  # what a row written before migration 0006 holds
        session.execute(text("UPDATE policies SET cameras = NULL"))
        session.execute(text("UPDATE evaluations SET cameras = NULL"))
        session.commit()
    assert api.client.get(f"/policies/{policy['id']}", headers=api.auth).json()["cameras"] == {}
    assert api.client.get(f"/evaluations/{body['id']}", headers=api.auth).json()["cameras"] == {}
    assert "State only" in api.client.get(f"/ui/evaluations/{body['id']}", headers=api.auth).text
