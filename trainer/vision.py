"""A vision policy's image side: SigLIP vision tower + LLaVA projector, built from the card's ``vision``.

:class:`VisionTower` is ``transformers``' own classes — ``SiglipVisionModel`` (from
``SiglipVisionConfig``, no pooling head) and ``LlavaMultiModalProjector`` (linear, GELU,
linear) — so its state dict is the standard layout the checkpoint stores::

    vision_model.embeddings.patch_embedding.{weight,bias}     [width, 3, patch, patch]
    vision_model.embeddings.position_embedding.weight         [patches, width]
    vision_model.encoder.layers.{i}.…                         SigLIP encoder layers
    vision_model.post_layernorm.{weight,bias}                 (kept for SiglipVisionModel; LLaVA does not use it)
    multi_modal_projector.linear_1.{weight,bias}              [text_hidden, width]
    multi_modal_projector.linear_2.{weight,bias}              [text_hidden, text_hidden]

``vision_model.*`` is what SigLIP vision checkpoints on the Hub hold (``SiglipVisionModel``
loads it under its ``base_model_prefix``); ``multi_modal_projector.*`` is LLaVA's. The
features are the encoder's ``hidden_states[feature_layer]`` (LLaVA's
``vision_feature_layer``, with the ``full`` selection strategy: SigLIP has no CLS token),
projected: one row per patch, row-major, ``[images, patches, text_hidden]``.

The policy server has its own copy of this small wrapper (services never import the
trainer); both are tested against ``transformers`` numerically.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from policy_format import VisionEncoder

PROJECTOR_PREFIX = "multi_modal_projector."
ENCODER_PREFIX = "vision_model."


class VisionTower(nn.Module):
    """Pixels ``[N, 3, H, W]`` (preprocessed by ``policy_format.pixel_values``) → image rows ``[N, P, text_hidden]``."""

    def __init__(self, vision: VisionEncoder, text_hidden_size: int) -> None:
        super().__init__()
        from transformers import LlavaConfig, SiglipVisionConfig, SiglipVisionModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.vision = vision
        config = SiglipVisionConfig(**vision.siglip_config())
        self.vision_model = SiglipVisionModel(config)
        llava = LlavaConfig(vision_config=config.to_dict(), text_config={"model_type": "llama",
                                                                         "hidden_size": text_hidden_size},
                            projector_hidden_act=vision.projector_act, vision_feature_layer=vision.feature_layer,
                            vision_feature_select_strategy="full", multimodal_projector_bias=True)
        self.multi_modal_projector = LlavaMultiModalProjector(llava)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.vision_model(pixel_values, output_hidden_states=True)
        return self.multi_modal_projector(out.hidden_states[self.vision.feature_layer])


def state_dict_for_file(tower: VisionTower) -> dict[str, torch.Tensor]:
    """The tower's tensors under the checkpoint's names (see the module docstring), contiguous, on the CPU."""
    return {name: t.detach().to("cpu").contiguous() for name, t in tower.state_dict().items()}


def save_vision_weights(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``vision_model.*`` + ``multi_modal_projector.*`` tensors to ``path`` (safetensors)."""
    from safetensors.torch import save_file

    bad = sorted(k for k in state if not k.startswith((ENCODER_PREFIX, PROJECTOR_PREFIX)))
    if bad:
        raise ValueError(f"vision weights must be {ENCODER_PREFIX}* or {PROJECTOR_PREFIX}*, got {bad[:3]}")
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    return path


# --- training ----------------------------------------------------------------------------

VISION_PREFIX = "vision."
"""Where :class:`VisionGPTModel` keeps the tower: its training-checkpoint names are ``vision.<file name>``."""


def _gpt_model_class() -> type:
    from trainer.model import TrainerGPTModel

    class VisionGPTModel(TrainerGPTModel):
        """The policy's decoder with a :class:`VisionTower` (``self.vision``) whose rows replace the image positions.

        A ``TrainerGPTModel`` subclass, so the decoder's parameter names (and the HF adapter,
        the checkpoint code) stay as they are; the tower's parameters are ``vision.*``,
        replicated on every rank. ``forward`` takes ``pixel_values`` ``[b, cameras, 3, H, W]``:
        the token embeddings of ``image_slice`` are replaced by the projected patches and the
        decoder runs on that (megatron's ``decoder_input``). Pipeline size 1 only.

        With ``environment_state_dim`` (and ``environment_state_loss`` > 0) it also has two
        :class:`EnvironmentStateHead` s, training only (the export leaves them out): one over the
        sample's image rows (``environment_head``: the encoder must report the hidden state) and
        one over the decoder's output at ``action_position``, where the first action token is
        predicted (``decoder_environment_head``: the decoder must carry it to where it acts).
        When ``forward`` is given ``environment_state`` targets it sets ``self.auxiliary_loss``
        to (weight × the two MSEs' sum, their mean) for the training loop to add and log.
        """

        def __init__(self, *args, vision: VisionEncoder, image_slice: slice, environment_state_dim: int = 0,
                     environment_state_loss: float = 0.0, action_position: int = -1, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.vision = VisionTower(vision, self.config.hidden_size)
            self.image_slice = image_slice
            self.environment_state_loss = environment_state_loss
            self.auxiliary_loss: tuple[torch.Tensor, torch.Tensor] | None = None
            self._decoder_output: torch.Tensor | None = None
            if environment_state_dim and environment_state_loss > 0:
                rows = image_slice.stop - image_slice.start
                self.environment_head = EnvironmentStateHead(rows * self.config.hidden_size, environment_state_dim)
                self.decoder_environment_head = EnvironmentStateHead(self.config.hidden_size, environment_state_dim)
                self.action_position = action_position

                def keep_output(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
                    self._decoder_output = output  # [s, b, h], after the final layer norm

                self.decoder.register_forward_hook(keep_output)

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    labels: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                    environment_state: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
            self.auxiliary_loss = self._decoder_output = None
            auxiliary = pixel_values is not None and environment_state is not None and hasattr(self, "environment_head")
            if pixel_values is not None:
                b, cameras = pixel_values.shape[:2]
                rows = self.vision(pixel_values.flatten(0, 1)).reshape(b, -1, self.config.hidden_size)
                embeds = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
                where = self.image_slice
                embeds = torch.cat([embeds[:where.start], rows.transpose(0, 1).to(embeds.dtype),
                                    embeds[where.stop:]])
                kwargs["decoder_input"] = embeds
            output = super().forward(input_ids, position_ids, attention_mask, labels=labels, **kwargs)
            if auxiliary:
                target = environment_state.float()
                rows_mse = nn.functional.mse_loss(self.environment_head(rows.flatten(1).float()), target)
                acting = self._decoder_output[self.action_position].float()  # [b, h]
                decoder_mse = nn.functional.mse_loss(self.decoder_environment_head(acting), target)
                self._decoder_output = None
                self.auxiliary_loss = ((rows_mse + decoder_mse) * self.environment_state_loss,
                                       (rows_mse + decoder_mse) / 2)
            return output

    return VisionGPTModel


class EnvironmentStateHead(nn.Module):
    """Training only: features of a sample → the state the policy is not shown (a two-layer MLP).

    ``VisionGPTModel`` has two: one over every projected patch of every camera, flattened (so
    its input keeps where in the image each feature is), and one over the decoder's output where
    it acts. Their regression loss (``vision.environment_state_loss``) teaches the encoder and the
    decoder to carry what the images show of the hidden state — a pixel suite's goal — instead of
    leaving that to be inferred from action targets alone; the policy never receives the hidden
    state, and ``trainer export`` leaves the heads out.
    """

    def __init__(self, in_features: int, out_features: int, hidden: int = 256) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden)
        self.linear_2 = nn.Linear(hidden, out_features)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.linear_2(nn.functional.gelu(self.linear_1(rows)))


ENVIRONMENT_HEAD_PREFIXES = ("environment_head.", "decoder_environment_head.")
"""Training-checkpoint names of the :class:`EnvironmentStateHead` s, which no export keeps."""


def build_vision_model(cfg: Any, vision: VisionEncoder, image_slice: slice, *, environment_state_dim: int = 0,
                       environment_state_loss: float = 0.0, action_position: int = -1) -> torch.nn.Module:
    """``trainer.model.build_model`` of a vision policy (see ``VisionGPTModel``)."""
    from megatron.core import parallel_state

    from trainer.config import ConfigError
    from trainer.model import build_model

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ConfigError("a vision policy trains with parallel.pipeline 1 (the encoder feeds the first stage)")
    return build_model(cfg, model_class=_gpt_model_class(), vision=vision, image_slice=image_slice,
                       environment_state_dim=environment_state_dim, environment_state_loss=environment_state_loss,
                       action_position=action_position)


def split_vision_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A training checkpoint's tensors → (the decoder's, the vision file's under its own names); the
    training-only :class:`EnvironmentStateHead` is in neither."""
    vision = {k.removeprefix(VISION_PREFIX): v for k, v in state.items() if k.startswith(VISION_PREFIX)}
    return {k: v for k, v in state.items()
            if not k.startswith((VISION_PREFIX, *ENVIRONMENT_HEAD_PREFIXES))}, vision


class CameraImages:
    """Every frame of a dataset's cameras (card order), and the batch's ``pixel_values``.

    Frames are decoded once at construction (uint8, at the recorded size); a batch runs
    ``policy_format.pixel_values`` on each sample's frames — the policy server's own
    preprocessing, resize included — after the optional augmentation:

    - ``shift`` (pixels): pad by replicating the edge and crop back at a random offset of up
      to ``shift`` each way (DrQ's random shift);
    - ``color_jitter`` (fraction): scale brightness and contrast each by a random factor in
      ``[1 − j, 1 + j]``.

    ``blank``: every image is black (a control run: what the policy learns without seeing).
    """

    def __init__(self, dataset: Any, cameras: Sequence[Any], *, shift: int = 0, color_jitter: float = 0.0,
                 blank: bool = False) -> None:
        from trainer.data.lerobot import DatasetError

        missing = [c.name for c in cameras if c.name not in dataset.cameras]
        if missing:
            raise DatasetError(f"{dataset.root}: has no frames of camera(s) {missing} (it records "
                               f"{', '.join(dataset.cameras) or 'no cameras'}); record them with "
                               "`trainer collect-demos --cameras`")
        self.cameras = tuple(cameras)
        self.shift, self.color_jitter, self.blank = shift, color_jitter, blank
        self.frames = {c.name: np.concatenate([dataset.frames(i, c.name) for i in range(len(dataset))])
                       for c in self.cameras}

    def pixel_values(self, indices: np.ndarray, rng: np.random.Generator | None = None) -> torch.Tensor:
        """float32 ``[b, cameras, 3, H, W]`` of frame ``indices``; ``rng`` draws the augmentation."""
        from policy_format import pixel_values

        out = []
        for index in np.asarray(indices):
            images = {}
            for camera in self.cameras:
                frame = self.frames[camera.name][index]
                if self.blank:
                    frame = np.zeros_like(frame)
                elif rng is not None:
                    frame = self._augment(frame, rng)
                images[camera.name] = frame
            out.append(pixel_values(images, self.cameras))
        return torch.from_numpy(np.stack(out))

    def _augment(self, frame: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.shift:
            s = self.shift
            padded = np.pad(frame, ((s, s), (s, s), (0, 0)), mode="edge")
            dy, dx = rng.integers(0, 2 * s + 1, 2)
            frame = padded[dy:dy + frame.shape[0], dx:dx + frame.shape[1]]
        if self.color_jitter:
            j = self.color_jitter
            brightness, contrast = rng.uniform(1 - j, 1 + j, 2)
            f = frame.astype(np.float32)
            mean = f.mean()
            frame = np.clip((f - mean) * contrast + mean * brightness, 0, 255).astype(np.uint8)
        return np.ascontiguousarray(frame)
