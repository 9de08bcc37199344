"""Message parsing: every request and reply type, and every malformed one; cameras in the
handshake and images in observations; the frame cap with camera-sized observations."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from services.protocol.codec import DEFAULT_LIMITS, ProtocolError, packb, unpackb
from services.protocol.messages import (
    MAX_CAMERAS,
    PROTOCOL_VERSION,
    ActionsReply,
    BareObservationRequest,
    ErrorCode,
    ErrorReply,
    InferRequest,
    InvalidImage,
    InvalidObservation,
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
    "bad images": (_infer(obs={"state": STATE, "task": "t", "images": {"a": STATE}}), InvalidImage,
                   r"camera 'a' must be uint8 \[H, W, 3\], got float32 \[4\]"),
    "images not a map": (_infer(obs={"state": STATE, "task": "t", "images": [1]}), InvalidObservation,
                         "'images' must map camera names"),
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


# --------------------------------------------------------------------------- cameras and images

CAMERAS = {"corner": (96, 96), "gripper": (64, 80)}
# A metadata frame as the code before cameras (commit 650ce7c) wrote it: Metadata("reach-bc", "ab" * 32,
# 39, 4, 4, ("reach-v3", "push-v3"), extra={"engine": "hf", "suite": "metaworld-mt1-reach"}, revision="v1.0").
METADATA_FRAME_BEFORE_CAMERAS = bytes.fromhex(
    "8aa474797065a86d65746164617461b070726f746f636f6c5f76657273696f6e01ab706f6c6963795f6e616d65a872656163682d6263"
    "b1636865636b706f696e745f736861323536d940" + "6162" * 32 + "a973746174655f64696d27aa616374696f6e5f64696d04"
    "aa6368756e6b5f73697a6504a57461736b7392a872656163682d7633a7707573682d7633a5657874726182a6656e67696e65a26866"
    "a57375697465b36d657461776f726c642d6d74312d7265616368a87265766973696f6ea476312e30")


def _image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _images(sizes=CAMERAS) -> dict[str, np.ndarray]:
    return {name: _image(h, w, i) for i, (name, (h, w)) in enumerate(sizes.items())}


def test_metadata_announces_cameras_in_order_and_omits_them_when_there_are_none():
    meta = Metadata("p", "ab" * 32, 39, 4, 4, ("reach-v3",), cameras={"gripper": (64, 80), "corner": (96, 96)})
    assert meta.to_wire()["cameras"] == {"gripper": [64, 80], "corner": [96, 96]}
    parsed = Metadata.from_wire(_wire(meta))
    assert parsed == meta and list(parsed.cameras) == ["gripper", "corner"]
    assert "cameras" not in Metadata("p", "ab" * 32, 39, 4, 4, ("reach-v3",)).to_wire()


def test_a_metadata_frame_from_before_cameras_still_parses():
    meta = Metadata.from_wire(unpackb(METADATA_FRAME_BEFORE_CAMERAS))
    assert meta == Metadata("reach-bc", "ab" * 32, 39, 4, 4, ("reach-v3", "push-v3"),
                            extra={"engine": "hf", "suite": "metaworld-mt1-reach"}, revision="v1.0")
    assert meta.cameras == {}
    # the state-only handshake the current code writes is that frame, byte for byte
    assert packb(meta.to_wire()) == METADATA_FRAME_BEFORE_CAMERAS


BAD_CAMERAS = {
    "not a map": (["corner"], "'cameras' must map camera names"),
    "too many": ({f"c{i}": [8, 8] for i in range(MAX_CAMERAS + 1)}, f"17 cameras; a policy takes at most {MAX_CAMERAS}"),
    "name with a slash": ({"a/b": [8, 8]}, "does not match"),
    "name too long": ({"c" * 65: [8, 8]}, "does not match"),
    "size not a pair": ({"corner": [96]}, r"camera 'corner' must be \[height, width\]"),
    "size zero": ({"corner": [0, 96]}, "from 1 to 4096"),
    "size too big": ({"corner": [96, 4097]}, "from 1 to 4096"),
    "size a float": ({"corner": [96.0, 96]}, "integers"),
    "size a bool": ({"corner": [True, 96]}, "integers"),
}


@pytest.mark.parametrize("name", list(BAD_CAMERAS))
def test_metadata_cameras_are_capped_and_checked(name):
    cameras, pattern = BAD_CAMERAS[name]
    wire = {**Metadata("p", "ab" * 32, 39, 4, 4, ("reach-v3",)).to_wire(), "cameras": cameras}
    with pytest.raises(ProtocolError, match=pattern) as caught:
        Metadata.from_wire(wire)
    assert "c" * 65 not in str(caught.value)  # a peer's long name is never quoted


def test_check_images_accepts_the_expected_cameras_and_ignores_others():
    obs = Observation(STATE, "t", {**_images(), "extra": np.zeros((2, 2, 3), np.uint8)})
    obs.check_images(CAMERAS)
    obs.check_images({})


BAD_IMAGES = {
    "missing camera": ({"corner": _image(96, 96)},
                       r"no image of camera 'gripper', which this policy needs as uint8 \[64, 80, 3\] under "
                       r"'images'; cameras sent: 'corner'"),
    "float32 image": ({**_images(), "gripper": _image(64, 80).astype(np.float32) / 255},
                      r"camera 'gripper' must be uint8 \[64, 80, 3\], got float32 \[64, 80, 3\]; images are "
                      r"never converted \(a float image is refused, not rescaled\)"),
    "wrong shape": ({**_images(), "corner": _image(96, 64)},
                    r"camera 'corner' must be uint8 \[96, 96, 3\], got uint8 \[96, 64, 3\]; render it at 96x96"),
    "grey, 2-D": ({**_images(), "corner": _image(96, 96)[..., 0].copy()},
                  r"camera 'corner' must be uint8 \[96, 96, 3\], got uint8 \[96, 96\]"),
    "RGBA": ({**_images(), "corner": np.zeros((96, 96, 4), np.uint8)}, r"got uint8 \[96, 96, 4\]"),
    "oversized": ({**_images(), "corner": _image(1024, 1024)}, r"got uint8 \[1024, 1024, 3\]"),
    "not an array": ({**_images(), "corner": [[0, 0, 0]]}, r"camera 'corner' must be a uint8 \[96, 96, 3\] array, "
                                                           r"got a list"),
    "non-contiguous": ({**_images(), "corner": _image(96, 192)[:, ::2]},
                       r"camera 'corner' must be a C-contiguous uint8 \[96, 96, 3\] array, got a strided view; "
                       r"pass numpy.ascontiguousarray"),
}


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_check_images_names_the_camera_the_expected_shape_and_what_came(name):
    images, pattern = BAD_IMAGES[name]
    with pytest.raises(InvalidImage, match=pattern) as caught:
        Observation(STATE, "t", images).check_images(CAMERAS)
    assert caught.value.camera in CAMERAS and isinstance(caught.value, InvalidObservation)
    assert len(str(caught.value)) < 400  # never the image's contents


@pytest.mark.parametrize("name", [n for n in BAD_IMAGES if n != "non-contiguous"])  # decoded arrays are contiguous
def test_a_policys_cameras_are_checked_while_parsing_an_infer_request(name):
    images, pattern = BAD_IMAGES[name]
    msg = unpackb(packb(_infer(obs={"state": STATE, "task": "t", "images": images})))  # not to_wire: it refuses them
    with pytest.raises(InvalidImage, match=pattern):
        parse_request(msg, CAMERAS)
    parse_request(_wire(InferRequest(1, Observation(STATE, "t", _images()))), CAMERAS)


def test_without_cameras_any_well_formed_images_are_accepted_and_others_refused():
    parsed = parse_request(_wire(InferRequest(1, Observation(STATE, "t", _images()))))
    assert {k: v.shape for k, v in parsed.obs.images.items()} == {"corner": (96, 96, 3), "gripper": (64, 80, 3)}
    with pytest.raises(InvalidImage, match=r"camera 'x' must be uint8 \[H, W, 3\], got float64 \[8, 8, 3\]"):
        parse_request(_infer(obs={"state": STATE, "task": "t", "images": {"x": np.zeros((8, 8, 3))}}))
    with pytest.raises(InvalidImage, match=r"camera 'x' must be uint8 \[H, W, 3\], got uint8 \[0, 8, 3\]"):
        parse_request(_infer(obs={"state": STATE, "task": "t", "images": {"x": np.zeros((0, 8, 3), np.uint8)}}))
    with pytest.raises(InvalidObservation, match="a bytes key; camera names are strings"):
        Observation.from_wire({"state": STATE, "task": "t", "images": {b"x": _image(8, 8)}})


@pytest.mark.parametrize("image, pattern", [
    (np.zeros((8, 8, 3), np.float32), r"got float32 \[8, 8, 3\]"),
    (np.zeros((8, 8), np.uint8), r"got uint8 \[8, 8\]"),
    (np.zeros((8, 16, 3), np.uint8)[:, ::2], "C-contiguous"),
    ("pixels", "got a str"),
], ids=["float32", "2-D", "non-contiguous", "not an array"])
def test_to_wire_refuses_images_the_protocol_does_not_carry_before_anything_is_sent(image, pattern):
    with pytest.raises(InvalidImage, match=pattern) as caught:
        InferRequest(1, Observation(STATE, "t", {"corner": image})).to_wire()
    assert caught.value.camera == "corner"


def test_invalid_image_has_its_own_error_code_and_pickles_with_its_camera():
    assert ErrorCode.INVALID_IMAGE == "invalid_image"
    error = pickle.loads(pickle.dumps(InvalidImage("corner", "image of camera 'corner' is missing")))
    assert (error.camera, str(error)) == ("corner", "image of camera 'corner' is missing")


def test_a_four_camera_224_observation_fits_the_default_frame_cap():
    sizes = {name: (224, 224) for name in ("corner", "gripper", "top", "side")}
    frame = packb(InferRequest(1, Observation(STATE, "reach-v3", _images(sizes))).to_wire())
    assert len(frame) < DEFAULT_LIMITS.max_frame_bytes
    parsed = parse_request(unpackb(frame, DEFAULT_LIMITS), sizes)
    for name, image in _images(sizes).items():
        np.testing.assert_array_equal(parsed.obs.images[name], image)


def test_a_100_mb_frame_is_refused_by_the_default_frame_cap():
    side = 5800  # 5800 x 5800 x 3 bytes: about 100.9 MB
    frame = packb(InferRequest(1, Observation(STATE, "reach-v3", {"corner": np.zeros((side, side, 3), np.uint8)}))
                  .to_wire())
    assert len(frame) > 100_000_000
    with pytest.raises(ProtocolError, match=f"frame of {len(frame)} bytes is over the "
                                            f"{DEFAULT_LIMITS.max_frame_bytes}-byte cap"):
        unpackb(frame, DEFAULT_LIMITS)
