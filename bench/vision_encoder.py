"""Vision encoder cost: the policy server's batched encoder against one forward per observation.

    python bench/vision_encoder.py [--image-size 64] [--patch-size 16] [--width 128] [--layers 2] [--repeats 3]

A random vision policy (``trainer init-policy --vision``, the recipe's encoder size by default:
configs/vla-reach-pixels.yaml) is loaded with the server's own loader; N observations of one
camera are encoded (a) through ``BatchedVisionEncoder`` all at once — what requests arriving in one
scheduling window get — and (b) one ``forward`` per observation, as an unbatched server would.
Prints images/s of each and their ratio per N (best of ``--repeats``, interleaved ABAB so that
load from other jobs hits both alike), and the hf engine's time for one chunk next to one
image's encoder time (the encoder's share of a request's time).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--patch-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--counts", default="1,8,32,64")
    args = parser.parse_args()

    import torch

    from policy_format import load_checkpoint, pixel_values
    from services.policy_server.engines import HfEngine
    from services.policy_server.vision import BatchedVisionEncoder, load_vision_tower
    from trainer.cli import main as trainer_main

    out = Path(tempfile.mkdtemp()) / "vision"
    trainer_main(["init-policy", "--out", str(out), "--state-dim", "36", "--action-dim", "4", "--tasks", "reach-v3",
                  "--cameras", "corner", "--image-size", str(args.image_size), "--vision",
                  "--patch-size", str(args.patch_size), "--vision-width", str(args.width),
                  "--vision-layers", str(args.layers), "--vision-heads", "2"])
    ckpt = load_checkpoint(out)
    encoder = BatchedVisionEncoder(load_vision_tower(ckpt))
    rng = np.random.default_rng(0)
    counts = [int(c) for c in args.counts.split(",")]
    pixels = [pixel_values({"corner": rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)},
                           ckpt.card.cameras) for _ in range(max(counts))]

    async def batched(n: int) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(encoder.encode(p) for p in pixels[:n]))
        return time.perf_counter() - start

    def single(n: int) -> float:
        start = time.perf_counter()
        for p in pixels[:n]:
            encoder.forward(p)
        return time.perf_counter() - start

    print(f"encoder: {args.image_size}x{args.image_size}, patch {args.patch_size} "
          f"({ckpt.card.vision.tokens_per_image} rows), width {args.width}, {args.layers} layers; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'images':>7} {'batched img/s':>14} {'one-at-a-time img/s':>20} {'ratio':>6} {'forwards':>9}")
    for n in counts:
        best_b = best_s = float("inf")
        forwards = encoder.forwards
        for _ in range(args.repeats):
            best_b = min(best_b, asyncio.run(batched(n)))
            best_s = min(best_s, single(n))
        per_window = (encoder.forwards - forwards) / args.repeats
        print(f"{n:>7} {n / best_b:>14.0f} {n / best_s:>20.0f} {best_s / best_b:>6.2f} {per_window:>9.0f}")

    engine = HfEngine(ckpt)
    engine._model = engine._load()
    prompt = ckpt.tokenizer.prompt("reach-v3", np.zeros(36, np.float32))
    rows = encoder.forward(pixels[0]).reshape(-1, encoder.forward(pixels[0]).shape[-1])
    chunk = min(_timed(lambda: engine.generate_sync(prompt, image_rows=rows)) for _ in range(args.repeats))
    one = min(_timed(lambda: encoder.forward(pixels[0])) for _ in range(args.repeats))
    print(f"hf engine, one chunk ({ckpt.tokenizer.action_len} tokens): {chunk * 1e3:.1f} ms; one image through the "
          f"encoder: {one * 1e3:.2f} ms ({one / (one + chunk):.0%} of the two)")
    encoder.close()


def _timed(fn) -> float:  # noqa: ANN001 - a thunk
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
