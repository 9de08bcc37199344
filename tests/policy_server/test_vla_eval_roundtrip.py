"""Our vla-eval client against our own policy server's `/vla-eval` endpoint: the two halves of the
vla-eval protocol this project implements, meeting (PNG frames from one, decoded by the other; the
hello's `evalforge` block read back as the server's identity)."""

from __future__ import annotations

import numpy as np

from policy_format import checkpoint_digest
from services.protocol.adapters import make_client
from services.protocol.client import ClientSettings, PolicyError
from services.protocol.messages import Observation
from tests.policy_server.conftest import ACTION_DIM, CAMERAS, CHUNK, STATE_DIM, TASKS

FAST = ClientSettings(connect_deadline_s=20, call_timeout_s=60, initial_backoff_s=0.05, max_backoff_s=0.5)


def _observation(rng: np.random.Generator, **images_override) -> Observation:
    images = {name: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for name, (h, w) in CAMERAS.items()}
    return Observation(state=rng.standard_normal(STATE_DIM).astype(np.float32), task=TASKS[0],
                       images={**images, **images_override})


def test_our_client_reads_our_servers_identity_and_gets_one_row_per_observation(camera_server, camera_checkpoint):
    url = camera_server.ws_url.removesuffix("/ws") + "/vla-eval"
    rng = np.random.default_rng(0)
    with make_client("vla-eval", url, FAST) as client:
        info = client.connect()
        assert info.protocol == "vla-eval"
        assert info.checkpoint_sha256 == checkpoint_digest(camera_checkpoint)
        assert (info.state_dim, info.action_dim, info.chunk_size) == (STATE_DIM, ACTION_DIM, CHUNK)
        assert set(info.tasks) == set(TASKS) and info.cameras == CAMERAS
        rows = [client.infer(_observation(rng), episode_id="ep-1", step=i).actions for i in range(CHUNK + 1)]
        assert all(r.shape == (1, ACTION_DIM) and r.dtype == np.float32 for r in rows)
        # A frame of the wrong size travels as PNG and is refused by the server, naming the camera.
        try:
            client.infer(_observation(rng, corner=np.zeros((8, 8, 3), np.uint8)), episode_id="ep-2")
        except PolicyError as exc:
            assert "corner" in str(exc)
        else:
            raise AssertionError("a wrong-size frame was accepted")
        assert client.infer(_observation(rng), episode_id="ep-3").actions.shape == (1, ACTION_DIM)
