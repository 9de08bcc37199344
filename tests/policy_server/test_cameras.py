"""A policy that declares cameras, served for real (transformers engine, default frame cap).

The handshake announces the card's cameras; every infer, openpi-style bare and HTTP request
is held to them, and a bad image gets ``invalid_image`` naming the camera and the expected
shape while the connection and other clients carry on; a 4-camera 224² observation fits the
frame cap and a 100 MB frame is refused without taking the server down.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
import pytest

from services.protocol.client import AsyncPolicyClient, PolicyClient
from services.protocol.codec import DEFAULT_LIMITS, packb, unpackb
from services.protocol.messages import InvalidImage
from tests.policy_server.conftest import CAMERAS, TASKS, RawConnection, camera_images, random_state

EXPECTED = r"uint8 \[224, 224, 3\]"


@pytest.fixture
def raw(camera_server):
    conn = RawConnection(camera_server.ws_url)
    yield conn
    conn.close()


def _with(**changes) -> dict[str, object]:
    """The images a good request carries, with some cameras replaced (None: left out)."""
    images = camera_images(1)
    for camera, image in changes.items():
        if image is None:
            del images[camera]
        else:
            images[camera] = image
    return images


BAD_IMAGES = {
    "missing camera": (_with(gripper=None), "gripper", rf"no image of camera 'gripper', which this policy needs as "
                                                      rf"{EXPECTED}"),
    "float32 image": (_with(corner=np.zeros((224, 224, 3), np.float32)), "corner",
                      rf"camera 'corner' must be {EXPECTED}, got float32 \[224, 224, 3\]; .*float image is refused"),
    "wrong shape": (_with(corner=np.zeros((96, 96, 3), np.uint8)), "corner",
                    rf"camera 'corner' must be {EXPECTED}, got uint8 \[96, 96, 3\]; render it at 224x224"),
    "oversized": (_with(gripper=np.zeros((2048, 2048, 3), np.uint8)), "gripper",
                  rf"camera 'gripper' must be {EXPECTED}, got uint8 \[2048, 2048, 3\]"),
    "not an array": (_with(corner=b"\x00" * 64), "corner", rf"camera 'corner' must be a {EXPECTED} array, got a bytes"),
}


def test_the_handshake_announces_the_cards_cameras(camera_server):
    with PolicyClient(camera_server.ws_url) as client:
        assert client.metadata.cameras == CAMERAS and list(client.metadata.cameras) == ["corner", "gripper"]


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_a_bad_image_gets_invalid_image_naming_the_camera_and_the_connection_stays_usable(raw, name):
    images, camera, pattern = BAD_IMAGES[name]
    reply = raw.infer(request_id=7, images=images)
    assert (reply["type"], reply["code"], reply["request_id"]) == ("error", "invalid_image", 7)
    assert re.search(pattern, reply["message"]) and camera in reply["message"], reply["message"]
    assert "Traceback" not in reply["message"] and len(reply["message"]) < 400
    assert raw.infer(request_id=8, images=camera_images(2))["type"] == "actions"


def test_openpi_style_bare_requests_are_checked_the_same_way(raw):
    images, _, pattern = BAD_IMAGES["float32 image"]
    reply = raw.ask(packb({"state": random_state(3), "prompt": "push-v3", "images": images}))
    assert reply["type"] == "error" and reply["code"] == "invalid_image" and re.search(pattern, reply["message"])
    reply = raw.ask(packb({"state": random_state(3), "prompt": "push-v3"}))
    assert reply["code"] == "invalid_image" and "no image of camera 'corner'" in reply["message"]
    reply = raw.ask(packb({"state": random_state(3), "prompt": "push-v3", "images": camera_images(3)}))
    assert set(reply) == {"actions", "server_timing"}


def test_http_act_answers_422_with_the_same_message(raw, camera_server):
    images, _, pattern = BAD_IMAGES["wrong shape"]
    obs = {"state": random_state(4), "task": "reach-v3", "images": images}
    over_ws = raw.ask(packb({"type": "infer", "request_id": 1, "obs": obs}))["message"]
    response = httpx.post(f"{camera_server.http_url}/act", content=packb({"type": "infer", "request_id": 1, "obs": obs}),
                          headers={"content-type": "application/msgpack"})
    reply = unpackb(response.content)
    assert response.status_code == 422 and reply["code"] == "invalid_image" and reply["message"] == over_ws
    assert re.search(pattern, over_ws)
    # JSON bodies carry no arrays: a camera policy says which image is missing
    response = httpx.post(f"{camera_server.http_url}/act", json={"state": random_state(4).tolist(), "task": "reach-v3"})
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_image"
    assert "camera 'corner'" in response.json()["error"]["message"]
    good = {**obs, "images": camera_images(4)}
    response = httpx.post(f"{camera_server.http_url}/act", content=packb({"type": "infer", "request_id": 2, "obs": good}),
                          headers={"content-type": "application/msgpack"})
    assert response.status_code == 200 and unpackb(response.content)["actions"].shape == (4, 4)


def test_the_client_refuses_a_float_image_before_sending_and_keeps_working(camera_server):
    with PolicyClient(camera_server.ws_url) as client:
        with pytest.raises(InvalidImage, match=r"camera 'corner' must be uint8 \[H, W, 3\], got float64") as caught:
            client.infer({"state": random_state(5), "task": "reach-v3",
                          "images": {**camera_images(5), "corner": np.zeros((224, 224, 3))}})
        assert caught.value.camera == "corner"
        assert client.infer({"state": random_state(5), "task": "reach-v3", "images": camera_images(5)}).actions.shape \
            == (4, 4)


def test_a_four_camera_224_observation_is_served_within_the_default_cap(raw):
    images = camera_images(6, {name: (224, 224) for name in ("corner", "gripper", "top", "side")})
    frame = packb({"type": "infer", "request_id": 9, "obs": {"state": random_state(6), "task": "reach-v3",
                                                             "images": images}})
    assert 4 * 224 * 224 * 3 < len(frame) < DEFAULT_LIMITS.max_frame_bytes
    assert raw.ask(frame)["type"] == "actions"  # the cameras the policy does not take are ignored


def test_bad_input_and_a_100_mb_frame_leave_other_clients_served(camera_server):
    async def good_client() -> list[tuple[int, np.ndarray]]:
        async with AsyncPolicyClient(camera_server.ws_url) as client:
            results = []
            for seed in range(6):
                reply = await client.infer({"state": random_state(seed), "task": TASKS[seed % 3],
                                            "images": camera_images(seed)})
                results.append((seed, reply.actions))
            return results

    def bad_client() -> list[dict]:
        bad = RawConnection(camera_server.ws_url)
        replies = [bad.infer(request_id=i, images=BAD_IMAGES[name][0]) for i, name in enumerate(BAD_IMAGES)]
        big = np.zeros((5800, 5800, 3), np.uint8)  # 100.9 MB
        replies.append(bad.ask(packb({"type": "infer", "request_id": 99,
                                      "obs": {"state": random_state(0), "task": "reach-v3", "images": {"corner": big}}})))
        replies.append(bad.infer(request_id=100, images=camera_images(7)))
        bad.close()
        return replies

    async def main():
        return await asyncio.gather(good_client(), asyncio.to_thread(bad_client))

    good, bad = asyncio.run(main())
    assert [reply["code"] for reply in bad[:len(BAD_IMAGES)]] == ["invalid_image"] * len(BAD_IMAGES)
    assert bad[-2]["code"] == "bad_frame" and f"over the {DEFAULT_LIMITS.max_frame_bytes}-byte cap" in bad[-2]["message"]
    assert bad[-1]["type"] == "actions"  # the connection that sent all that is still served
    assert [seed for seed, _ in good] == list(range(6)) and all(a.shape == (4, 4) for _, a in good)
    metrics = httpx.get(f"{camera_server.http_url}/metrics").text
    assert re.search(r'evalforge_policy_errors_total\{code="invalid_image"\} [1-9]', metrics)
