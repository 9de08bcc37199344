"""A vision policy's encoder on the serving side: images in flight → image rows, one forward per window.

:class:`VisionTower` is the checkpoint's vision file as a module — ``transformers``'
``SiglipVisionModel`` and ``LlavaMultiModalProjector`` under the names the file uses
(``vision_model.*``, ``multi_modal_projector.*``; see ``trainer/vision.py``, the trainer's
twin of this wrapper, and docs/policy-format.md). Its output for one observation is
``[cameras × patches, text_hidden]``: the prompt's image rows, in card order.

:class:`BatchedVisionEncoder` batches it across requests: every observation's pixels
(``policy_format.pixel_values``) join a queue, and one encoder forward runs for all that
arrived in the same scheduling window — the event-loop iteration in which the first of
them arrived, plus whatever arrives while the previous forward runs. The forward runs on
a thread of its own, so the event loop keeps reading frames and sending replies (torch
releases the GIL in its kernels); each request then takes its rows to the engine, which
batches the language model continuously as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from policy_format import PolicyCheckpoint, VisionEncoder

log = logging.getLogger(__name__)


def build_vision_tower(vision: VisionEncoder, text_hidden_size: int) -> object:
    """An untrained :class:`VisionTower` (torch imported here, not at module import)."""
    import torch
    from transformers import LlavaConfig, SiglipVisionConfig, SiglipVisionModel
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    class VisionTower(torch.nn.Module):
        """Pixels ``[N, 3, H, W]`` → image rows ``[N, patches, text_hidden]``."""

        def __init__(self) -> None:
            super().__init__()
            config = SiglipVisionConfig(**vision.siglip_config())
            self.vision_model = SiglipVisionModel(config)
            llava = LlavaConfig(vision_config=config.to_dict(),
                                text_config={"model_type": "llama", "hidden_size": text_hidden_size},
                                projector_hidden_act=vision.projector_act, vision_feature_layer=vision.feature_layer,
                                vision_feature_select_strategy="full", multimodal_projector_bias=True)
            self.multi_modal_projector = LlavaMultiModalProjector(llava)

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            out = self.vision_model(pixel_values, output_hidden_states=True)
            return self.multi_modal_projector(out.hidden_states[vision.feature_layer])

    return VisionTower()


def load_vision_tower(checkpoint: PolicyCheckpoint) -> object:
    """The checkpoint's vision tower, weights loaded strictly (float32, eval mode)."""
    import torch
    from safetensors.torch import load_file

    vision = checkpoint.card.vision
    assert vision is not None, "not a vision policy"
    config = _read_config(checkpoint.directory)
    tower = build_vision_tower(vision, int(config["hidden_size"]))
    path = checkpoint.directory / vision.weights
    state = load_file(str(path))
    result = tower.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    # post_layernorm is part of SiglipVisionModel's layout; a file may leave it out (LLaVA never uses it)
    missing = [k for k in result.missing_keys if ".post_layernorm." not in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: the vision weights do not fit policy.json's vision section (missing "
                         f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}); re-export the checkpoint")
    return tower.eval()


def _read_config(directory: Path) -> dict:
    import json

    config = json.loads((directory / "config.json").read_text())
    return config.get("text_config", config)


class BatchedVisionEncoder:
    """Encodes the images of all observations in flight together (see the module docstring)."""

    def __init__(self, tower: object, *, max_batch_images: int = 256) -> None:
        self.tower = tower
        self.max_batch_images = max_batch_images
        self.on_batch: Callable[[int], None] | None = None  # told the image count of each forward
        self.on_cpu: Callable[[float], None] | None = None  # told the CPU seconds of each forward
        self.forwards = 0
        self.images = 0
        self.cpu_seconds = 0.0  # the encoder thread's CPU time in forwards (time.thread_time)
        self._pending: list[tuple[np.ndarray, asyncio.Future]] = []
        self._draining = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="vision-encoder")

    async def encode(self, pixels: np.ndarray) -> object:
        """float32 torch rows ``[n × patches, text_hidden]`` of one observation's pixels ``[n, 3, H, W]``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending.append((pixels, future))
        if not self._draining:
            self._draining = True
            # call_soon: requests decoded later in this loop iteration join the same forward
            loop.call_soon(lambda: loop.create_task(self._drain()))
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, count = [], 0
                while self._pending and (not batch or count + len(self._pending[0][0]) <= self.max_batch_images):
                    item = self._pending.pop(0)
                    batch.append(item)
                    count += len(item[0])
                pixels = np.concatenate([p for p, _ in batch]) if len(batch) > 1 else batch[0][0]
                try:
                    rows = await loop.run_in_executor(self._executor, self.forward, pixels)
                except Exception as exc:  # every waiter hears of it; the server keeps serving
                    log.exception("vision encoder forward failed for %d images", len(pixels))
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                self.forwards += 1
                self.images += len(pixels)
                if self.on_batch is not None:
                    self.on_batch(len(pixels))
                start = 0
                for p, future in batch:
                    if not future.done():  # its request may have been cancelled meanwhile
                        future.set_result(rows[start:start + len(p)].reshape(-1, rows.shape[-1]))
                    start += len(p)
        finally:
            self._draining = False

    def forward(self, pixels: np.ndarray) -> object:
        """One encoder forward (blocking; the encoder's thread runs it): ``[N, patches, text_hidden]``.

        Its CPU time (the calling thread's, torch's one-thread pool included) adds to
        :attr:`cpu_seconds` and goes to :attr:`on_cpu`: what the encoder costs the serving
        cores, which on a small CPU host is what the vLLM engine loses."""
        import torch

        match_threads_to_cores(torch)
        cpu_start = time.thread_time()
        with torch.inference_mode():
            rows = self.tower(torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)))
        cpu = time.thread_time() - cpu_start
        self.cpu_seconds += cpu
        if self.on_cpu is not None:
            self.on_cpu(cpu)
        return rows

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def match_threads_to_cores(torch: object) -> int:
    """Run torch's intra-op pool with as many threads as the calling thread has cores, and return that.

    torch sizes its pool from the machine's cores at import, but the vLLM engine moves the serving
    process off its compute cores once it has started (``engines.move_off_compute_cores``): on two
    cores that leaves this process one, and a two-thread pool on one core makes every encoder forward
    wait on a descheduled thread. Checked at every forward (one ``sched_getaffinity`` call), since
    the move happens after the encoder is built."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.get_num_threads() != cores:
        torch.set_num_threads(cores)
    return cores
