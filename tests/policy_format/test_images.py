"""Image preprocessing (policy_format.images): resize as torch does, scale, camera order, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from policy_format import CameraInput, pixel_values, preprocess
from policy_format.images import resize


def _frame(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("size", [(32, 48), (13, 7), (64, 64)])
@pytest.mark.parametrize("method", ["bilinear", "nearest"])
def test_resize_matches_torch_interpolate(size, method):
    frame = _frame(24, 40)
    ours = resize(frame, *size, method).astype(np.float32)
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].float()
    kwargs = {"align_corners": False} if method == "bilinear" else {}
    want = F.interpolate(x, size=size, mode=method, **kwargs)[0].permute(1, 2, 0).numpy()
    np.testing.assert_allclose(ours, want, atol=1e-3)


def test_scales_and_layout():
    frame = np.array([[[0, 255, 127]]], dtype=np.uint8)
    signed = preprocess(frame, CameraInput("c", 1, 1, scale="signed"))
    unit = preprocess(frame, CameraInput("c", 1, 1, scale="unit"))
    assert signed.shape == unit.shape == (3, 1, 1) and signed.dtype == np.float32
    np.testing.assert_allclose(signed[:, 0, 0], [-1.0, 1.0, 127 / 127.5 - 1], atol=1e-6)
    np.testing.assert_allclose(unit[:, 0, 0], [0.0, 1.0, 127 / 255], atol=1e-6)


def test_pixel_values_follow_the_card_order_and_name_a_missing_camera():
    cameras = (CameraInput("b", 8, 8, scale="signed"), CameraInput("a", 8, 8, scale="signed"))
    images = {"a": _frame(8, 8, 1), "b": _frame(16, 16, 2)}
    out = pixel_values(images, cameras)
    assert out.shape == (2, 3, 8, 8)
    np.testing.assert_array_equal(out[1], preprocess(images["a"], cameras[1]))
    np.testing.assert_array_equal(out[0], preprocess(images["b"], cameras[0]))  # resized 16 → 8
    with pytest.raises(KeyError, match="camera 'b' is missing"):
        pixel_values({"a": images["a"]}, cameras)
    with pytest.raises(ValueError, match="camera 'a': a frame must be uint8"):
        preprocess(images["a"].astype(np.float32), cameras[1])
