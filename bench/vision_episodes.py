"""Episodes per minute with images: a vision policy against a state-only one, through the worker runner.

    .venv/bin/python bench/vision_episodes.py [--episodes 6] [--rounds 2] [--max-steps 100] [--engine vllm|hf]

Two random-init policies with one decoder shape (configs/vla-reach-pixels.yaml's: the 1m
preset, 64 bins, chunk 4; throughput does not depend on the weights):

- **vision**: ``trainer init-policy --vision`` for ``metaworld-mt1-reach-pixels``, the
  ``corner`` camera at 64×64, patch 16, encoder width 128 × 2 layers
  (``bench/policy_server.py``'s ``VISION_POLICY``); its evaluation shows it ``corner`` 64×64;
- **state only**: ``trainer init-policy`` for ``metaworld-mt1-reach``, no cameras.

Each behind a ``policy-server`` of its own (vLLM, ``--engine-core compute``, as ``evalforge
up`` runs it next to workers; ``--engine hf`` for transformers, which the test uses). Their episodes are stored rows of a scratch PostgreSQL
database (bench/eval_api.py's helpers), played by ``services.workers.runner.run_episode_by_id``
in this process — the function behind the Celery task, as bench/store_round_trips.py plays
it: the claim, the simulator (kept per process), the ``ActionChunkBroker``, the evaluation's
cameras rendered at the steps the broker infers, the result. The same evaluation seeds for
both policies, taking turns episode by episode (which goes first alternates), ``--rounds``
rounds of ``--episodes`` each, after one untimed warm-up episode each.

Where an inference's time goes:

- **render**: ``EpisodeEnv.render_images`` timed in this process (a timing wrapper on the
  class for the run; it is what ``services/workers/cameras.py`` calls);
- **codec**: one request's encode (``InferRequest.to_wire`` + ``packb``, the client) and decode
  (``unpackb`` + ``parse_request`` with the policy's cameras, the server), timed afterwards on
  frames rendered during the run — the whole request, and what its frame adds over the state alone;
- **encoder**: the vision server's ``evalforge_policy_encoder_seconds`` (``/metrics``): the
  request's wait for its image rows (preprocessing, the window's batched forward on the
  encoder's thread);
- **engine**: each server's ``evalforge_policy_engine_seconds``; its mean engine batch size too;
- **round trip**: the broker's (each row's ``latency_mean_ms``); *other* = round trip − codec −
  encoder − engine (the sockets, both event loops, the server's request handling).

Per step: the episode loop's time (each row's ``duration_s``) over its steps; *sim + worker*
= step time less render and round trips per step (physics, the runner's per-step work).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sqlalchemy import select

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eval_api import create_database, drop_database  # noqa: E402  (bench/eval_api.py)
from policy_server import CHUNK, VISION_CAMERA, VISION_IMAGE, VISION_POLICY, histogram  # noqa: E402  (bench/policy_server.py)

from benchmarks.suite import EpisodeEnv, evaluation_seed  # noqa: E402
from policy_format import checkpoint_digest, load_checkpoint  # noqa: E402
from services.protocol.codec import packb, unpackb  # noqa: E402
from services.protocol.messages import InferRequest, Observation, parse_request  # noqa: E402
from services.store import migrate, queries  # noqa: E402
from services.store.db import create_db_engine, make_session_factory  # noqa: E402
from services.store.models import Episode  # noqa: E402
from services.supervisor import PolicyServerProcess  # noqa: E402
from services.workers import runner  # noqa: E402
from services.workers.settings import WorkerSettings  # noqa: E402
from trainer.cli import main as trainer_main  # noqa: E402

TASK = "reach-v3"
STATE_SUITE = "metaworld-mt1-reach"
WARMUP_FIRST = 10_000  # the warm-up episode's evaluation seed, far from the timed ones


@dataclass
class Side:
    """One policy: its checkpoint, server, stored policy and the figures of its timed episodes."""

    name: str
    suite: str
    checkpoint: Path
    cameras: dict[str, list[int]]
    server: PolicyServerProcess | None = None
    policy_id: int = 0
    walls: list[float] = field(default_factory=list)  # run_episode_by_id's wall time per episode
    rows: list[Episode] = field(default_factory=list)
    per_round: list[list[float]] = field(default_factory=list)  # wall times of each round's episodes
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)  # histogram → (sum, count), timed part
    render_s: list[float] = field(default_factory=list)

    @property
    def metrics_url(self) -> str:
        assert self.server is not None
        return self.server.ws_url.replace("ws://", "http://").removesuffix("/ws") + "/metrics"

    def read_metrics(self) -> dict[str, tuple[float, float]]:
        return {name: histogram(self.metrics_url, f"evalforge_policy_{name}")
                for name in ("engine_seconds", "encoder_seconds", "engine_batch_size")}


class RenderClock:
    """Times every ``EpisodeEnv.render_images`` call while installed; keeps the last frames for the codec."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.frames: list[dict[str, np.ndarray]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[RenderClock]:
        original = EpisodeEnv.render_images
        clock = self

        def render_images(env: EpisodeEnv, cameras):  # noqa: ANN001, ANN202 - the wrapped method's signature
            start = time.perf_counter()
            frames = original(env, cameras)
            clock.seconds.append(time.perf_counter() - start)
            clock.frames = [*clock.frames[-31:], frames]
            return frames

        EpisodeEnv.render_images = render_images
        try:
            yield self
        finally:
            EpisodeEnv.render_images = original


def make_policies(root: Path) -> tuple[Side, Side]:
    vision = Side("vision (corner 64×64)", VISION_POLICY[VISION_POLICY.index("--suite") + 1], root / "vision",
                  {VISION_CAMERA: [VISION_IMAGE, VISION_IMAGE]})
    state = Side("state only", STATE_SUITE, root / "state", {})
    if not (vision.checkpoint / "policy.json").exists():
        trainer_main(["init-policy", "--out", str(vision.checkpoint), *VISION_POLICY, "--force"])
    if not (state.checkpoint / "policy.json").exists():
        trainer_main(["init-policy", "--out", str(state.checkpoint), "--suite", STATE_SUITE, "--preset", "1m",
                      "--bins", "64", "--chunk-size", str(CHUNK), "--force"])
    return vision, state


def register(sessions, side: Side) -> None:  # noqa: ANN001 - a sessionmaker
    card = load_checkpoint(side.checkpoint).card
    with sessions() as session:
        side.policy_id = queries.create_policy(
            session, name=side.checkpoint.name, version="bench", endpoint=side.server.ws_url,
            checkpoint_sha256=checkpoint_digest(side.checkpoint), state_dim=card.state_dim,
            action_dim=card.action_dim, chunk_size=card.chunk_size, tasks=[TASK],
            cameras=side.cameras or None).id


def evaluation(sessions, side: Side, seeds: list[int], max_steps: int) -> list[int]:  # noqa: ANN001
    specs = [queries.EpisodeSpec(task=TASK, seed=seed, max_steps=max_steps) for seed in seeds]
    with sessions() as session:
        return queries.create_evaluation(session, policy_id=side.policy_id, suite=side.suite, tasks=[TASK],
                                         episodes_per_task=len(seeds), seed=0, max_steps=max_steps, standard=False,
                                         tags=["bench-vision-episodes"], episodes=specs,
                                         cameras=side.cameras or None).episode_ids


def codec_ms(frames: list[dict[str, np.ndarray]], state_dim: int, cameras: dict[str, tuple[int, int]],
             repeats: int = 200) -> tuple[float, float]:
    """(whole request, what its frames add) in ms: encode + decode of one infer request, as client and server do."""
    state = np.zeros(state_dim, np.float32)

    def round_trip(obs: dict, expect: dict) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for i in range(repeats):
                frame = packb(InferRequest(request_id=i, obs=Observation.from_wire(obs), episode_id="e",
                                           step=i).to_wire())
                parse_request(unpackb(frame), expect)
            best = min(best, (time.perf_counter() - start) / repeats)
        return best * 1e3

    with_frames = statistics.median(round_trip({"state": state, "task": TASK, "images": f}, cameras)
                                    for f in frames[:3])
    without = round_trip({"state": state, "task": TASK}, {})
    return with_frames, with_frames - without


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=6, help="timed episodes per policy per round (default 6)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default 2): the spread between them is printed")
    parser.add_argument("--max-steps", type=int, default=100, help="step limit per episode (default 100; a random "
                                                                   "policy never succeeds, so every episode runs to it)")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="the servers' engine (default vllm)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "evalforge-bench-vision-episodes")
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.rounds < 1 or args.max_steps < 1:
        raise SystemExit("--episodes, --rounds and --max-steps must be at least 1")
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()
    sides = make_policies(args.workdir)
    database_url = create_database()
    engine = None
    clock = RenderClock()
    try:
        for side in sides:
            side.server = PolicyServerProcess(side.checkpoint, "--engine", args.engine, "--engine-core", "compute",
                                              "--log-level", "warning", log_dir=args.workdir).start()
            print(f"{side.name}: policy server ready at {side.server.ws_url}", file=sys.stderr, flush=True)
        migrate.upgrade(database_url)
        engine = create_db_engine(url=database_url)
        sessions = make_session_factory(engine)
        settings = WorkerSettings(replay_episodes=0)
        for side in sides:
            register(sessions, side)
        with clock.installed():
            for side in sides:  # the simulator, the connection and the server's first requests: untimed
                (warm,) = evaluation(sessions, side, [evaluation_seed(WARMUP_FIRST)], args.max_steps)
                runner.run_episode_by_id(sessions, warm, "bench", settings)
            clock.seconds.clear()
            before = {side.name: side.read_metrics() for side in sides}
            for r in range(args.rounds):
                seeds = [evaluation_seed(r * args.episodes + i) for i in range(args.episodes)]
                ids = {side.name: evaluation(sessions, side, seeds, args.max_steps) for side in sides}
                for side in sides:
                    side.per_round.append([])
                for i in range(args.episodes):
                    for side in (sides if i % 2 == 0 else sides[::-1]):
                        renders = len(clock.seconds)
                        start = time.perf_counter()
                        result = runner.run_episode_by_id(sessions, ids[side.name][i], "bench", settings)
                        wall = time.perf_counter() - start
                        if result.status not in ("succeeded", "failed") or result.failure_reason:
                            raise RuntimeError(f"{side.name}: episode {ids[side.name][i]} ended {result}")
                        side.walls.append(wall)
                        side.per_round[-1].append(wall)
                        side.render_s += clock.seconds[renders:]
                print(f"round {r + 1}: " + ", ".join(f"{s.name} {60 * len(s.per_round[-1]) / sum(s.per_round[-1]):.1f}"
                                                     f" episodes/min" for s in sides), file=sys.stderr, flush=True)
                with sessions() as session:
                    for side in sides:
                        side.rows += session.scalars(select(Episode).where(Episode.id.in_(ids[side.name]))).all()
            for side in sides:
                after = side.read_metrics()
                side.metrics = {k: (after[k][0] - before[side.name][k][0], after[k][1] - before[side.name][k][1])
                                for k in after}
        vision_card = load_checkpoint(sides[0].checkpoint).card
        codec = codec_ms(clock.frames, vision_card.state_dim, dict(vision_card.camera_sizes))
    finally:
        runner.close_caches()
        if engine is not None:
            engine.dispose()
        for side in sides:
            if side.server is not None:
                side.server.stop()
        drop_database(database_url)
    report(sides, args, started_at, load_start, codec)


def _inferences(row: Episode) -> int:
    return -(-(row.steps or 0) // CHUNK)  # one inference per chunk, the last one maybe cut short


def report(sides: tuple[Side, Side], args: argparse.Namespace, started_at: str, load_start: tuple[float, ...],
           codec: tuple[float, float]) -> None:
    load = os.getloadavg()
    print(f"# vision episodes — MetaWorld {TASK}, {args.rounds} rounds × {args.episodes} episodes per policy × "
          f"{args.max_steps} steps, evaluation seeds {evaluation_seed(0)}…{evaluation_seed(args.rounds * args.episodes - 1)}, "
          f"through services.workers.runner.run_episode_by_id against {args.engine} policy servers (--engine-core "
          "compute)")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"MUJOCO_GL={os.environ.get('MUJOCO_GL', '(unset)')}; started {started_at}, load average "
          f"{load_start[0]:.1f} / {load_start[1]:.1f} / {load_start[2]:.1f} then, "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end (1/5/15 min)\n")
    vision, state = sides
    print("| policy | episodes | episodes/min | per round | vs state only | per-seed wall ratio: median [min, max] "
          "| ms/step | inferences/episode | round trip ms | success |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    per_min = {s.name: 60 * len(s.walls) / sum(s.walls) for s in sides}
    for side in sides:
        rounds = " / ".join(f"{60 * len(w) / sum(w):.1f}" for w in side.per_round)
        ratios = [a / b for a, b in zip(side.walls, state.walls, strict=True)]
        steps = sum(r.steps or 0 for r in side.rows)
        inferences = sum(_inferences(r) for r in side.rows)
        print(f"| {side.name} | {len(side.walls)} | {per_min[side.name]:.1f} | {rounds} | "
              f"{per_min[side.name] / per_min[state.name]:.2f}× | {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}, {max(ratios):.2f}] | "
              f"{1e3 * sum(r.duration_s or 0 for r in side.rows) / steps:.1f} | {inferences / len(side.rows):.0f} | "
              f"{statistics.fmean(r.latency_mean_ms or 0 for r in side.rows):.1f} | "
              f"{sum(bool(r.success) for r in side.rows) / len(side.rows):.0%} |")
    print("\n# where the time goes, ms per inference (one inference per chunk of 4 steps)")
    print("| policy | step (loop) ×4 | render | codec (frame's share) | encoder wait | engine | other in the round trip "
          "| round trip | sim + worker | engine batch (mean) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for side in sides:
        inferences = sum(_inferences(r) for r in side.rows)
        loop_ms = 1e3 * sum(r.duration_s or 0 for r in side.rows) / inferences
        render_ms = 1e3 * sum(side.render_s) / inferences
        trip_ms = statistics.fmean(r.latency_mean_ms or 0 for r in side.rows)
        engine_s, engine_n = side.metrics["engine_seconds"]
        encoder_s, encoder_n = side.metrics["encoder_seconds"]
        batch_sum, batch_n = side.metrics["engine_batch_size"]
        engine_ms = 1e3 * engine_s / engine_n if engine_n else 0.0
        encoder_ms = 1e3 * encoder_s / encoder_n if encoder_n else 0.0
        codec_cell = f"{codec[0]:.2f} ({codec[1]:.2f})" if side.cameras else "—"
        codec_ms_ = codec[0] if side.cameras else 0.0
        print(f"| {side.name} | {loop_ms:.1f} | {render_ms:.1f} | {codec_cell} | "
              f"{encoder_ms:.1f} | {engine_ms:.1f} | {trip_ms - codec_ms_ - encoder_ms - engine_ms:.1f} | "
              f"{trip_ms:.1f} | {loop_ms - render_ms - trip_ms:.1f} | "
              f"{batch_sum / batch_n if batch_n else float('nan'):.1f} |")
    print(f"\ncodec: encode + decode of one infer request with the {VISION_CAMERA} frame "
          f"({VISION_IMAGE}×{VISION_IMAGE}×3 uint8), best of 5 × 200; the state-only request's codec is in "
          "'other' (a few µs)")


if __name__ == "__main__":
    main()
