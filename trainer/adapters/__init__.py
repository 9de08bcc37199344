"""State-dict adapters: megatron-core ``GPTModel`` weights ↔ Hugging Face causal-LM weights.

One adapter per model family, each the single place that knows how that family's
Hugging Face names and layouts relate to megatron-core's (the canonical names listed
in ``trainer/model.py``) and which ``config.json`` fields describe it:

- dense (``num_experts == 0``): :class:`~trainer.adapters.llama.LlamaAdapter` → ``LlamaForCausalLM``
- MoE (``num_experts > 0``): :class:`~trainer.adapters.mixtral.MixtralAdapter` → ``MixtralForCausalLM``

An adapter is built from the :class:`~trainer.config.ModelConfig` the weights belong to
and offers ``to_hf`` (megatron → HF, what ``trainer export`` writes), ``from_hf`` (HF →
megatron, to start training from a Hugging Face model) and ``hf_config`` (the
``config.json`` fields); ``model_config`` goes from an HF ``config.json`` back to a
``ModelConfig``. Both directions check every name and shape against the config and
refuse anything missing, extra or misshapen, so a checkpoint written for another
model never exports into a silently broken one.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from trainer.config import ModelConfig

__all__ = ["AdapterError", "StateDictAdapter", "adapter_for", "adapter_for_hf_config", "ARCHITECTURES"]

# HF architecture → "module:class"; imported on demand so each family stays in its own file
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "trainer.adapters.llama:LlamaAdapter",
    "MixtralForCausalLM": "trainer.adapters.mixtral:MixtralAdapter",
}


class AdapterError(ValueError):
    """Weights or a config that do not fit the adapter; the message names the input and the fix."""


class StateDictAdapter(ABC):
    """Maps one model family's weights between megatron-core and Hugging Face names and layouts."""

    architecture: ClassVar[str]
    """The Hugging Face class name written to ``config.json`` ``architectures``."""
    model_type: ClassVar[str]
    """The Hugging Face ``model_type`` (selects the config class in ``AutoConfig``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        cfg.validate()
        if cfg.vocab_size is None:
            raise AdapterError("model.vocab_size is not set; the adapter needs the embedding size the weights "
                               "were trained with (it is in the checkpoint's trainer.json)")
        if cfg.rope_base != int(cfg.rope_base):
            # build_model hands megatron int(rope_base): a fractional base would export a
            # different RoPE from the one the model was trained with
            raise AdapterError(f"model.rope_base {cfg.rope_base} is not a whole number; megatron's GPTModel "
                               "was built with int(rope_base), so the export cannot reproduce it exactly")
        self.cfg = cfg

    @property
    def head_dim(self) -> int:
        return self.cfg.hidden_size // self.cfg.num_attention_heads

    @abstractmethod
    def megatron_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical megatron-core name this config has, with its full (unsplit) shape."""

    @abstractmethod
    def hf_config(self) -> dict[str, Any]:
        """``config.json`` fields (``architectures`` and ``model_type`` included)."""

    @abstractmethod
    def _to_hf(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The mapping itself, on a state dict already checked against :meth:`megatron_shapes`."""

    @abstractmethod
    def _from_hf(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The inverse mapping, on an HF state dict already checked against :meth:`hf_shapes`."""

    @classmethod
    @abstractmethod
    def model_config(cls, hf_config: Mapping[str, Any]) -> ModelConfig:
        """The ``ModelConfig`` whose megatron model holds the same weights as ``hf_config``'s."""

    def to_hf(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """megatron-core canonical state dict (full tensors) → Hugging Face state dict."""
        state = dict(state)
        if self.cfg.tie_embeddings:
            # a last pipeline stage keeps its own copy of the tied embedding as output_layer;
            # the HF model ties lm_head to embed_tokens instead, so the copy is not exported
            state.pop("output_layer.weight", None)
        _check(state, self.megatron_shapes(), "megatron state dict",
               "export the checkpoint with the model config it was trained with (its trainer.json)")
        return self._to_hf(state)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face name this config has, with its shape (derived from the mapping)."""
        meta = {name: torch.empty(shape, device="meta") for name, shape in self.megatron_shapes().items()}
        return {name: tuple(t.shape) for name, t in self._to_hf(meta).items()}

    def from_hf(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Hugging Face state dict → megatron-core canonical state dict (full tensors)."""
        state = self._normalize_hf(dict(state))
        if self.cfg.tie_embeddings:
            state.pop("lm_head.weight", None)  # transformers lists the tied head in state_dict()
        _check(state, self.hf_shapes(), f"{self.architecture} state dict",
               "build the adapter from that model's config.json (adapter_for_hf_config)")
        return self._from_hf(state)

    def _normalize_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Hook for families whose in-memory transformers layout differs from the files' layout."""
        return state


def adapter_for(cfg: ModelConfig) -> StateDictAdapter:
    """The adapter for ``cfg``'s family: Mixtral for MoE, Llama for dense."""
    return _adapter_class("MixtralForCausalLM" if cfg.is_moe else "LlamaForCausalLM")(cfg)


def adapter_for_hf_config(hf_config: Mapping[str, Any]) -> StateDictAdapter:
    """The adapter (and ``ModelConfig``) for a Hugging Face ``config.json``."""
    architectures = hf_config.get("architectures") or []
    known = [a for a in architectures if a in ARCHITECTURES]
    if not known:
        raise AdapterError(f"config.json architectures {architectures} has no supported architecture; "
                           f"supported: {', '.join(ARCHITECTURES)}")
    cls = _adapter_class(known[0])
    return cls(cls.model_config(hf_config))


def _adapter_class(architecture: str) -> type[StateDictAdapter]:
    module_name, _, class_name = ARCHITECTURES[architecture].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _check(state: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]], what: str, fix: str) -> None:
    """Refuse missing, unexpected or misshapen tensors, naming a few of each."""
    missing = [n for n in expected if n not in state]
    extra = [n for n in state if n not in expected]
    wrong = [f"{n}: {tuple(state[n].shape)}, expected {expected[n]}"
             for n in expected if n in state and tuple(state[n].shape) != expected[n]]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    if extra:
        problems.append(f"{len(extra)} unexpected ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})")
    if wrong:
        problems.append(f"{len(wrong)} with the wrong shape ({'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''})")
    if problems:
        raise AdapterError(f"{what} does not match the model config: tensors " + ", ".join(problems) + f". Fix: {fix}")
