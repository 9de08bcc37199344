"""`trainer init-policy`: an untrained, randomly initialised policy checkpoint.

It has real weights (a Llama causal LM in safetensors) and a valid policy.json,
so a whole pipeline — server, workers, evaluation — can be checked before
anything is trained. Sizes: ``--preset 1m`` (about 1 M parameters) or ``25m``;
any field can be overridden.

``--cameras corner,gripper`` makes the card declare those cameras (format version 2),
at ``--image-size`` (``96`` for 96×96, or ``HxW``) or, with ``--suite``, at the suite's
default size for each camera; the policy server then asks for and checks those images.
Without ``--vision`` the model stays a state-only language model: the images are
validated on the path but not seen by the model.

``--vision`` makes a vision policy (policy.json format version 3): a random SigLIP vision
tower (``--patch-size``, ``--vision-width``, ``--vision-layers``, ``--vision-heads``) and
LLaVA projector in ``vision.safetensors`` (``trainer/vision.py``), cameras scaled to
[-1, 1], square at ``--image-size`` (the encoder's), and ``model.safetensors.index.json``
naming the language model's file. The prompt gains one row per patch per camera.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from policy_format import CameraInput, PolicyCard, PolicyFormatError, VisionEncoder, write_lm_index

PRESETS = {
    # hidden, layers, heads, kv heads, intermediate
    "1m": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=384),
    "25m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1408),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    parser.add_argument("--suite", help="benchmark suite the policy is for (sets dims and tasks)")
    parser.add_argument("--state-dim", type=int, help="state vector size (when no --suite)")
    parser.add_argument("--action-dim", type=int, help="action vector size (when no --suite)")
    parser.add_argument("--tasks", help="comma-separated task names (when no --suite)")
    parser.add_argument("--chunk-size", type=int, default=4, help="actions per inference")
    parser.add_argument("--bins", type=int, default=256, help="bins per state and action dimension")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1m")
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--init-std", type=float, default=0.02, help="weight initialisation std")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cameras", help="comma-separated cameras the policy takes (default: none, state only)")
    parser.add_argument("--image-size", type=image_size, metavar="N|HxW",
                        help="size of every camera's images: N for NxN or HxW (default: the suite's camera sizes)")
    parser.add_argument("--vision", action="store_true",
                        help="a vision policy: a SigLIP encoder + projector sees the cameras (needs --cameras)")
    parser.add_argument("--patch-size", type=int, default=8, help="vision: patch side, pixels")
    parser.add_argument("--vision-width", type=int, default=64, help="vision: encoder hidden size")
    parser.add_argument("--vision-layers", type=int, default=2, help="vision: encoder layers")
    parser.add_argument("--vision-heads", type=int, default=2, help="vision: encoder attention heads")
    parser.add_argument("--name", help="policy name (default: the output directory's name)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")


def image_size(text: str) -> tuple[int, int]:
    """``--image-size``: ``96`` → (96, 96); ``96x128`` → (96, 128), height first."""
    parts = text.lower().split("x")
    if len(parts) in (1, 2) and all(part.isdigit() and int(part) > 0 for part in parts):
        height, width = int(parts[0]), int(parts[-1])
        return height, width
    raise argparse.ArgumentTypeError(f"{text!r} is not an image size; give N (N x N pixels) or HxW, e.g. 96 or 96x128")


def camera_inputs(suite: str | None, names: str | None, size: tuple[int, int] | None) -> list[CameraInput]:
    """The cameras the card declares: ``names`` at ``size``, or at the suite's sizes when no size is given."""
    cameras = [name.strip() for name in (names or "").split(",") if name.strip()]
    if not cameras:
        if size is not None:
            raise SystemExit("trainer init-policy: --image-size needs --cameras (which cameras take that size)")
        return []
    if len(set(cameras)) != len(cameras):
        raise SystemExit(f"trainer init-policy: --cameras must name distinct cameras, got {cameras}")
    if suite is not None:
        from benchmarks.registry import get_suite
        from benchmarks.suite import SuiteError

        try:
            sizes = get_suite(suite).resolve_cameras(cameras if size is None else {c: list(size) for c in cameras})
        except SuiteError as exc:
            raise SystemExit(f"trainer init-policy: {exc}") from None
    elif size is None:
        raise SystemExit("trainer init-policy: --cameras without --suite needs --image-size (N or HxW): no suite "
                         "says the cameras' sizes")
    else:
        sizes = {camera: size for camera in cameras}
    return [CameraInput(name=camera, height=height, width=width) for camera, (height, width) in sizes.items()]


def suite_dims(suite: str) -> tuple[int, int, list[str], dict[str, str]]:
    """State dim, action dim, tasks and instructions of a benchmark suite."""
    from benchmarks.registry import get_suite
    from benchmarks.suite import SuiteError

    try:
        s = get_suite(suite)
    except SuiteError as exc:
        raise SystemExit(f"trainer init-policy: {exc}") from None
    return s.state_dim, s.action_dim, list(s.task_names), {t: s.instruction(t) for t in s.task_names}


def run(args: argparse.Namespace) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.suite:
        state_dim, action_dim, tasks, instructions = suite_dims(args.suite)
    else:
        if not (args.state_dim and args.action_dim and args.tasks):
            raise SystemExit("trainer init-policy: give --suite, or all of --state-dim, --action-dim and --tasks")
        state_dim, action_dim = args.state_dim, args.action_dim
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        instructions = {}
    if len(set(tasks)) != len(tasks) or not tasks:
        raise SystemExit(f"trainer init-policy: --tasks must name distinct tasks, got {tasks}")
    cameras = camera_inputs(args.suite, args.cameras, args.image_size)
    vision = vision_encoder(args, cameras) if getattr(args, "vision", False) else None
    if vision is not None:
        cameras = [dataclasses.replace(camera, scale="signed") for camera in cameras]
    out: Path = args.out
    if (out / "policy.json").exists() and not args.force:
        raise SystemExit(f"trainer init-policy: {out} already holds a checkpoint; pass --force to overwrite it")
    card = PolicyCard(
        name=args.name or out.name, suite=args.suite, state_dim=state_dim, action_dim=action_dim,
        chunk_size=args.chunk_size, tasks=tasks, instructions=instructions,
        state_low=[-1.0] * state_dim, state_high=[1.0] * state_dim,
        action_low=[-1.0] * action_dim, action_high=[1.0] * action_dim,
        state_bins=args.bins, action_bins=args.bins, cameras=cameras, vision=vision,
        provenance={"dataset": None, "steps": 0, "init": f"random (std {args.init_std}, seed {args.seed})"},
    )
    try:
        card.validate()  # before any file is written
    except PolicyFormatError as exc:
        raise SystemExit(f"trainer init-policy: {exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(PRESETS[args.preset])
    if args.hidden_size:
        shape["hidden_size"] = args.hidden_size
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    config = LlamaConfig(
        vocab_size=card.layout.vocab_size,
        max_position_embeddings=card.image_len + 1 + state_dim + args.chunk_size * action_dim + 64,
        tie_word_embeddings=False, initializer_range=args.init_std,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    params = sum(p.numel() for p in model.parameters())
    if vision is not None:
        from trainer.vision import VisionTower, save_vision_weights, state_dict_for_file

        tower = VisionTower(vision, config.hidden_size).to(torch.float32)
        save_vision_weights(state_dict_for_file(tower), out / vision.weights)
        lm = model.state_dict()
        write_lm_index(out, list(lm), sum(t.numel() * t.element_size() for t in lm.values()))
        params += sum(p.numel() for p in tower.parameters())
    card.write(out)
    print(f"wrote an untrained policy with {params / 1e6:.2f} M parameters to {out}")
    return out


def vision_encoder(args: argparse.Namespace, cameras: list[CameraInput]) -> VisionEncoder:
    """The random vision policy's encoder: square cameras at one size, the flags' shape."""
    if not cameras:
        raise SystemExit("trainer init-policy: --vision needs --cameras (the images the encoder sees)")
    sizes = {camera.size for camera in cameras}
    if len(sizes) != 1 or next(iter(sizes))[0] != next(iter(sizes))[1]:
        raise SystemExit(f"trainer init-policy: --vision needs every camera square at one size, got "
                         f"{sorted(sizes)}; pass --image-size N")
    width = args.vision_width
    vision = VisionEncoder(image_size=next(iter(sizes))[0], patch_size=args.patch_size, hidden_size=width,
                           intermediate_size=4 * width, num_hidden_layers=args.vision_layers,
                           num_attention_heads=args.vision_heads)
    problem = vision.problem()
    if problem:
        raise SystemExit(f"trainer init-policy: {problem.replace('vision.', '--vision ')}")
    return vision
