"""Message parsing: every request and reply type, and every malformed one."""

from __future__ import annotations

import numpy as np
import pytest

from services.protocol.codec import ProtocolError, packb, unpackb
from services.protocol.messages import (
    PROTOCOL_VERSION,
    ActionsReply,
    BareObservationRequest,
    ErrorReply,
    InferRequest,
    Metadata,
    Observation,
    PingRequest,
    PongReply,
    ProtocolVersionMismatch,
    ResetRequest,
    UnknownMessageType,
    parse_reply,
    parse_request,
)

STATE = np.arange(4, dtype=np.float32)


def _wire(message) -> object:
    return unpackb(packb(message.to_wire()))


def test_requests_round_trip_through_the_codec():
    infer = InferRequest(request_id=3, obs=Observation(STATE, "reach-v3"), episode_id="e", step=7)
    parsed = parse_request(_wire(infer))
    assert isinstance(parsed, InferRequest)
    assert (parsed.request_id, parsed.episode_id, parsed.step, parsed.obs.task) == (3, "e", 7, "reach-v3")
    np.testing.assert_array_equal(parsed.obs.state, STATE)
    assert parse_request(_wire(ResetRequest(request_id="r", episode_id="e"))) == ResetRequest("r", "e")
    assert parse_request(_wire(PingRequest(request_id=9))) == PingRequest(9)


def test_images_travel_with_the_observation():
    image = np.zeros((8, 8, 3), np.uint8)
    parsed = parse_request(_wire(InferRequest(1, Observation(STATE, "t", {"top": image}))))
    assert parsed.obs.images["top"].shape == (8, 8, 3)


def test_a_bare_dict_is_an_openpi_style_request():
    parsed = parse_request({"state": STATE, "prompt": "reach"})
    assert isinstance(parsed, BareObservationRequest) and parsed.obs["prompt"] == "reach"


def test_replies_round_trip_through_the_codec():
    actions = np.ones((4, 2), np.float32)
    parsed = parse_reply(_wire(ActionsReply(1, actions, {"engine_ms": 1.5})))
    assert isinstance(parsed, ActionsReply) and parsed.timing == {"engine_ms": 1.5}
    assert parse_reply(_wire(ErrorReply(2, "unknown_task", "no"))) == ErrorReply(2, "unknown_task", "no")
    assert parse_reply(_wire(PongReply(4))) == PongReply(4)


def test_metadata_round_trips_and_checks_the_version():
    meta = Metadata("p", "ab" * 32, 39, 4, 4, ("reach-v3",), extra={"suite": "metaworld-mt1-reach"})
    assert Metadata.from_wire(_wire(meta)) == meta
    with pytest.raises(ProtocolError, match="protocol version 2"):
        Metadata.from_wire({**meta.to_wire(), "protocol_version": 2})
    with pytest.raises(ProtocolError, match="metadata"):
        Metadata.from_wire({"type": "actions"})
    with pytest.raises(ProtocolError, match="'state_dim' must be int"):
        Metadata.from_wire({**meta.to_wire(), "state_dim": "39"})


def _infer(**changes):
    msg = {"type": "infer", "request_id": 1, "episode_id": "e", "step": 0, "obs": {"state": STATE, "task": "t"}}
    msg.update(changes)
    return msg


BAD_REQUESTS = {
    "not a map": ([1, 2], ProtocolError, "must be a map"),
    "empty": ({}, ProtocolError, "empty request"),
    "unknown type": ({"type": "dance", "request_id": 1}, UnknownMessageType, "unknown request type 'dance'"),
    "version mismatch": (_infer(protocol_version=2), ProtocolVersionMismatch, "version 2"),
    "missing request_id": ({"type": "ping"}, ProtocolError, "missing the 'request_id'"),
    "bool request_id": ({"type": "ping", "request_id": True}, ProtocolError, "request_id"),
    "missing obs": ({"type": "infer", "request_id": 1}, ProtocolError, "missing the 'obs'"),
    "obs not a map": (_infer(obs=[1]), ProtocolError, "'obs' must be a map"),
    "missing state": (_infer(obs={"task": "t"}), ProtocolError, "missing the 'state'"),
    "state a list": (_infer(obs={"state": [1.0], "task": "t"}), ProtocolError, "'state' must be an array"),
    "state float64": (_infer(obs={"state": STATE.astype(np.float64), "task": "t"}), ProtocolError, "float32"),
    "state 2-D": (_infer(obs={"state": STATE.reshape(2, 2), "task": "t"}), ProtocolError, r"shape \[2, 2\]"),
    "state NaN": (_infer(obs={"state": np.array([np.nan], np.float32), "task": "t"}), ProtocolError, "NaN"),
    "state inf": (_infer(obs={"state": np.array([np.inf], np.float32), "task": "t"}), ProtocolError, "infinity"),
    "task missing": (_infer(obs={"state": STATE}), ProtocolError, "'task' must be a string"),
    "bad images": (_infer(obs={"state": STATE, "task": "t", "images": {"a": STATE}}), ProtocolError, "images"),
    "negative step": (_infer(step=-1), ProtocolError, "'step'"),
    "bad episode": (_infer(episode_id=[1]), ProtocolError, "'episode_id'"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_malformed_requests_name_the_problem(name):
    msg, error, pattern = BAD_REQUESTS[name]
    with pytest.raises(error, match=pattern):
        parse_request(msg)


@pytest.mark.parametrize(
    "msg, pattern",
    [
        ({"type": "actions", "request_id": 1, "actions": [1.0]}, "float32 array"),
        ({"type": "actions", "request_id": 1, "actions": np.ones((1, 1, 1), np.float32)}, "float32 array"),
        ({"type": "error", "request_id": 1, "code": 5, "message": "x"}, "string fields"),
        ({"type": "nope"}, "unknown reply type"),
        ({"actions": np.ones((1, 1), np.float32)}, "openpi-style"),
        ("text", "must be a map"),
    ],
)
def test_malformed_replies_name_the_problem(msg, pattern):
    with pytest.raises(ProtocolError, match=pattern):
        parse_reply(msg)


def test_protocol_version_constant_is_sent_in_every_request():
    for request in (InferRequest(1, Observation(STATE, "t")), ResetRequest(1), PingRequest(1)):
        assert request.to_wire()["protocol_version"] == PROTOCOL_VERSION
