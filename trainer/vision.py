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

from pathlib import Path

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
