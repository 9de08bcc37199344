"""The images a policy takes: its cameras, its vision encoder, and image preprocessing, once.

A policy that sees images lists them in policy.json (see :mod:`policy_format.card`), in
the order the prompt takes them::

    "cameras": [{"name": "corner", "height": 64, "width": 64, "resize": "bilinear", "scale": "signed"}]

- ``name``: the camera, as the simulator suite and the wire protocol's ``images`` map name
  it (``[A-Za-z0-9_.-]{1,64}``);
- ``height``, ``width``: the size the policy takes, pixels (1 to :data:`MAX_IMAGE_SIDE`); the
  server refuses other sizes and evaluations render at this one;
- ``resize``: how a frame of another size is brought to it where a pipeline resizes
  (training data recorded at another size): ``bilinear`` (half-pixel centres, no
  antialiasing — what ``torch.nn.functional.interpolate(mode="bilinear",
  align_corners=False)`` does) or ``nearest``;
- ``scale``: how uint8 pixels become model inputs: ``unit`` is ``pixel / 255`` in [0, 1];
  ``signed`` is ``pixel / 127.5 − 1`` in [−1, 1] (SigLIP's mean 0.5, std 0.5), what
  vision policies take.

Images always travel as uint8 [height, width, 3] RGB. The card's caps are the wire
protocol's (``services.protocol.messages``: ``MAX_CAMERAS``, ``MAX_IMAGE_SIDE``,
``CAMERA_NAME_PATTERN``), restated here because neither package imports the other; a test
in ``tests/policy_server`` checks that they agree.

**Vision policies** (format version 3) also carry a :class:`VisionEncoder`: a SigLIP
vision tower and a LLaVA two-layer MLP projector, whose weights are a second safetensors
file in the checkpoint. Each camera's image becomes ``tokens_per_image`` prompt rows (one
per patch, row-major), cameras in card order. :func:`pixel_values` is the one
preprocessing both the trainer (its training frames) and the policy server (each
request's images) run, so the two cannot drift apart.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

MAX_CAMERAS = 16
MAX_IMAGE_SIDE = 4096
CAMERA_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
RESIZE_METHODS = ("bilinear", "nearest")
SCALES = ("unit", "signed")
VISION_WEIGHTS = "vision.safetensors"
"""The file name ``trainer`` gives a vision policy's encoder and projector weights."""


@dataclass(frozen=True)
class CameraInput:
    """One camera a policy takes: its name, the size it takes, and how frames are resized and scaled."""

    name: str
    height: int
    width: int
    resize: str = "bilinear"
    scale: str = "unit"

    @property
    def size(self) -> tuple[int, int]:
        """(height, width)."""
        return self.height, self.width


@dataclass(frozen=True)
class VisionEncoder:
    """A vision policy's encoder and projector: what policy.json's ``vision`` section says.

    The encoder is ``transformers``' ``SiglipVisionModel`` with these fields of its
    ``SiglipVisionConfig`` (3 channels, no pooling head); its output at ``feature_layer``
    (``hidden_states[-1]``: the last encoder layer, before the post-layernorm, as LLaVA
    takes it) goes through ``multi_modal_projector`` (``linear_1`` → ``projector_act`` →
    ``linear_2``, with biases) into the language model's hidden size. ``weights`` is the
    safetensors file, relative to the checkpoint, holding ``vision_model.*`` and
    ``multi_modal_projector.*``.
    """

    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    projector_act: str = "gelu"
    feature_layer: int = -1
    weights: str = VISION_WEIGHTS

    @property
    def tokens_per_image(self) -> int:
        """Prompt rows per camera: one per patch."""
        return (self.image_size // self.patch_size) ** 2

    def problem(self) -> str | None:
        """What is wrong with these numbers, or None."""
        ints = ("image_size", "patch_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
        for name in ints:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                return f"vision.{name} must be an integer ≥ 1, got {value!r}"
        if self.image_size % self.patch_size:
            return f"vision.image_size ({self.image_size}) must be a multiple of vision.patch_size ({self.patch_size})"
        if self.hidden_size % self.num_attention_heads:
            return (f"vision.hidden_size ({self.hidden_size}) must be a multiple of vision.num_attention_heads "
                    f"({self.num_attention_heads})")
        if type(self.feature_layer) is not int or not -self.num_hidden_layers <= self.feature_layer < 0:
            return (f"vision.feature_layer must be an integer from -{self.num_hidden_layers} to -1, got "
                    f"{self.feature_layer!r}")
        if not isinstance(self.weights, str) or not self.weights.endswith(".safetensors") or "/" in self.weights \
                or self.weights.startswith(".") or self.weights == "model.safetensors":
            return (f"vision.weights must name a *.safetensors file in the checkpoint directory other than "
                    f"model.safetensors, got {self.weights!r}")
        return None

    def siglip_config(self) -> dict[str, Any]:
        """Keyword arguments of ``transformers.SiglipVisionConfig`` for this encoder."""
        return {"image_size": self.image_size, "patch_size": self.patch_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads, "layer_norm_eps": self.layer_norm_eps,
                "hidden_act": self.hidden_act, "num_channels": 3, "vision_use_head": False}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def resize(frame: np.ndarray, height: int, width: int, method: str) -> np.ndarray:
    """``frame`` (uint8 ``[h, w, 3]``) at ``height × width``: float32 for ``bilinear``, uint8 for ``nearest``.

    ``bilinear`` samples at half-pixel centres with edge clamping and no antialiasing
    (``torch.nn.functional.interpolate(..., mode="bilinear", align_corners=False)``);
    ``nearest`` takes pixel ``floor(i · h / height)`` (torch's ``nearest``). A frame already
    at the size is returned as is.
    """
    h, w = frame.shape[:2]
    if (h, w) == (height, width):
        return frame
    if method == "nearest":
        rows = np.minimum((np.arange(height) * (h / height)).astype(np.int64), h - 1)
        cols = np.minimum((np.arange(width) * (w / width)).astype(np.int64), w - 1)
        return frame[rows[:, None], cols[None, :]]
    if method != "bilinear":
        raise ValueError(f"resize method {method!r} is not one of {', '.join(RESIZE_METHODS)}")

    def taps(out: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = np.maximum((np.arange(out, dtype=np.float64) + 0.5) * (size / out) - 0.5, 0.0)
        low = np.minimum(x.astype(np.int64), size - 1)
        return low, np.minimum(low + 1, size - 1), (x - low).astype(np.float32)

    r0, r1, fr = taps(height, h)
    c0, c1, fc = taps(width, w)
    src = frame.astype(np.float32)
    top = src[r0] * (1 - fr)[:, None, None] + src[r1] * fr[:, None, None]
    return top[:, c0] * (1 - fc)[None, :, None] + top[:, c1] * fc[None, :, None]


def preprocess(frame: np.ndarray, camera: CameraInput) -> np.ndarray:
    """One uint8 ``[h, w, 3]`` RGB frame → float32 ``[3, height, width]``, resized and scaled as ``camera`` says."""
    frame = np.asarray(frame)
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"camera {camera.name!r}: a frame must be uint8 [H, W, 3] RGB, got {frame.dtype} "
                         f"{list(frame.shape)}")
    pixels = resize(frame, camera.height, camera.width, camera.resize).astype(np.float32, copy=False)
    if camera.scale == "signed":
        pixels = pixels * np.float32(1 / 127.5) - np.float32(1.0)
    else:
        pixels = pixels * np.float32(1 / 255)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def pixel_values(images: Mapping[str, np.ndarray], cameras: Sequence[CameraInput]) -> np.ndarray:
    """float32 ``[len(cameras), 3, H, W]``: each camera's frame from ``images``, preprocessed, in card order.

    The model input of one observation; the trainer and the policy server both call this.
    Cameras must share one size (the encoder's). A missing camera raises ``KeyError``
    naming it.
    """
    out = []
    for camera in cameras:
        if camera.name not in images:
            raise KeyError(f"camera {camera.name!r} is missing; the policy takes {[c.name for c in cameras]}")
        out.append(preprocess(images[camera.name], camera))
    return np.stack(out) if out else np.zeros((0, 3, 1, 1), dtype=np.float32)
