"""Vision encoder cost: the policy server's batched encoder against one forward per observation.

    python bench/vision_encoder.py [--image-size 64] [--patch-size 16] [--width 128] [--layers 2] [--repeats 3]

A random vision policy (``trainer init-policy --vision``, the recipe's encoder size by default:
configs/vla-reach-pixels.yaml) is loaded with the server's own loader; N observations of one
camera are encoded (a) through ``BatchedVisionEncoder`` all at once — what requests arriving in one
scheduling window get — and (b) one ``forward`` per observation, as an unbatched server would.
Prints images/s of each and their ratio per N (best of ``--repeats``, interleaved ABAB so that
load from other jobs hits both alike), and the hf engine's time for one chunk next to one
image's encoder time (the encoder's share of a request's time).

A third table (Linux, two cores or more) times one forward of a scheduling window's images
(``--window``, 4 by default: what a window holds at 64 clients in ``bench/policy_server.py``)
on the last core, alone and beside work that a policy server on a small host has beside its
encoder: a Python busy loop and a one-thread torch matmul loop (vLLM's CPU worker) on another
core, and a ``sched_yield()`` spinner (vLLM's engine core waiting on its worker) on the same
core. What the other core's work costs the forward is a slowdown that no placement of the
encoder's thread avoids (docs/benchmarks.md has the figures). Each helper is a process that
stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
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
    parser.add_argument("--window", type=int, default=4, help="images per forward in the neighbours table")
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
                           ckpt.card.cameras) for _ in range(max(*counts, args.window))]

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
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        neighbours(encoder, np.concatenate(pixels[:args.window]), args.repeats)
    encoder.close()


# Work beside the encoder, each a helper process: (name, its core: "other" or "same", its loop).
# Each stops by itself after a minute, should this script die before it kills them.
NEIGHBOURS = (
    ("a busy loop on another core", "other", "while time.time() < deadline: pass"),
    ("a torch matmul loop on another core (vLLM's worker)", "other",
     "import torch; torch.set_num_threads(1); a = torch.randn(256, 256)\n"
     "while time.time() < deadline: a @ a"),
    ("a sched_yield() spinner on the same core (vLLM's engine core)", "same",
     "while time.time() < deadline: os.sched_yield()"),
)


def neighbours(encoder, pixels: np.ndarray, repeats: int, forwards: int = 200) -> None:  # noqa: ANN001
    """Time ``forwards`` encoder forwards of ``pixels`` on this process's last core, alone and beside
    each of NEIGHBOURS (rounds interleaved, best of ``repeats``); print wall and CPU ms per forward."""
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    mine, other = cores[-1], cores[0]
    os.sched_setaffinity(0, {mine})

    def timed() -> tuple[float, float]:
        for _ in range(10):
            encoder.forward(pixels)
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(forwards):
            encoder.forward(pixels)
        return (time.perf_counter() - wall) / forwards * 1e3, (time.thread_time() - cpu) / forwards * 1e3

    results: dict[str, list[tuple[float, float]]] = {"alone": [], **{name: [] for name, _, _ in NEIGHBOURS}}
    try:
        for _ in range(repeats):
            results["alone"].append(timed())
            for name, where, loop in NEIGHBOURS:
                core = other if where == "other" else mine
                code = (f"import os, time\nos.sched_setaffinity(0, {{{core}}})\ndeadline = time.time() + 60\n"
                        f"{loop}")
                helper = subprocess.Popen([sys.executable, "-c", code])
                try:
                    time.sleep(1.0)  # torch's import
                    results[name].append(timed())
                finally:
                    helper.kill()
                    helper.wait()
    finally:
        os.sched_setaffinity(0, before)
    alone = min(w for w, _ in results["alone"])
    print(f"\none forward of {len(pixels)} images on core {mine}, beside other work (best of {repeats}, "
          f"{forwards} forwards each)")
    print(f"{'beside':<62} {'wall ms':>8} {'CPU ms':>7} {'vs alone':>9}")
    for name, rounds in results.items():
        wall, cpu = min(rounds)
        print(f"{name:<62} {wall:>8.3f} {cpu:>7.3f} {wall / alone:>8.2f}x")


def _timed(fn) -> float:  # noqa: ANN001 - a thunk
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
