"""`trainer collect-demos`: run a suite's scripted expert and write a LeRobot v3 demonstration dataset.

    trainer collect-demos --suite metaworld-mt10 --episodes-per-task 50 --out data/mt10-demos
    trainer collect-demos --suite metaworld-mt1-reach-pixels --episodes-per-task 50 --out data/reach-px \
        --cameras corner,gripper --image-size 96

For each task of the suite the expert plays episodes from consecutive seeds S,
S+1, ... (S = --seed, default 0) until it has --episodes-per-task successful
ones, or has tried --max-attempts seeds (default: twice the target, at least
target + 10). Failed episodes are not kept; the table printed at the end gives
the expert's success rate per task (successes / attempts).

Seeds: demonstrations use seeds below ``benchmarks.suite.EVAL_SEED_START``
(1,000,000); evaluations use seeds from there upward (``evaluation_seed(i)``), so
no policy is evaluated from an initial state it saw in training. The command
refuses a seed range that would reach the evaluation seeds.

Cameras: ``--cameras corner,gripper`` records, at every step, the frame each
camera shows before the expert acts (what a policy would see; ``env.render_images``),
at the suite's default size or ``--image-size N`` (N × N). ``--image-dtype video``
(the default) stores them as LeRobot v3 AV1 videos, ``image`` as a PNG per frame in
the data files (lossless; for small sets). The worker that plays an episode also
encodes its frames (one encoder thread each), so --workers bounds the encoding too.

Resuming: each attempted episode is saved the moment it ends, as one file per
(task, seed) under the work folder OUT.collect/ beside the dataset (written
atomically; LeRobot wants nothing but the dataset inside OUT). Re-running the
command skips those and continues; a larger --episodes-per-task extends the
dataset. The dataset itself (OUT/data, OUT/meta, OUT/videos) is then rebuilt from
those files in (task, seed) order — the first N successful seeds of each task — so
its content depends on the arguments only, never on worker timing or
interruptions. Keep OUT.collect/ to resume or extend later; delete it to save
space. A collection made before the work folder moved (OUT/.collect/) is moved
beside the dataset on the next run, and its dataset rewritten in today's layout.

Noise (DART, Laskey et al. 2017): ``--action-noise SIGMA`` plays each step with the
expert's action plus Gaussian noise of standard deviation SIGMA times the half-range
of the action bounds (then clipped), and records the expert's clean action for the
state it reached. The demos then show how to come back from the small mistakes a
learned policy makes, which a noise-free expert never makes. The noise of an episode
is drawn from its (task, seed), so the dataset still depends on the arguments only.

Work is spread over --workers processes (default: the usable CPU cores), each
keeping a few simulators alive between episodes. The dataset layout is described
in trainer/data/lerobot.py and docs/datasets.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.registry import EVAL_SEED_START, NoExpertError, Suite, SuiteError, get_suite
from lerobot_format.episode_file import camera_arrays, camera_frames
from trainer.data.lerobot import EVALFORGE_PATH, IMAGE_DTYPES, CameraFrames, Episode, write_dataset

WORK_SUFFIX = ".collect"  # the work folder is OUT.collect, beside OUT
OLD_WORK_DIR = ".collect"  # where it was before: inside OUT
RUN_FILE = "run.json"
RUN_FORMAT = 2  # 2: cameras and image dtype are part of a collection's identity
# Bumped whenever write_dataset's layout changes, so a resumed collection rewrites its dataset.
DATASET_LAYOUT = 3  # 3: observation.environment_state (what a pixel suite hides)
# Simulators a worker keeps alive: building one costs ~0.1-0.2 s, an episode of MetaWorld
# ~0.05 s, so rebuilding per episode would dominate; a small bound caps memory on MT50.
ENVS_PER_WORKER = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", required=True, help="benchmark suite (`python -m benchmarks` lists them)")
    parser.add_argument("--episodes-per-task", required=True, type=int, metavar="N",
                        help="successful episodes to keep per task")
    parser.add_argument("--out", required=True, type=Path, help="dataset directory (created, or resumed)")
    parser.add_argument("--seed", type=int, default=0,
                        help=f"first episode seed (default 0; must stay below {EVAL_SEED_START:,}, "
                             "where evaluation seeds start)")
    parser.add_argument("--workers", type=int, default=None,
                        help="parallel processes (default: usable CPU cores)")
    parser.add_argument("--max-attempts", type=int, default=None, metavar="M",
                        help="seeds to try per task at most (default: max(2N, N + 10))")
    parser.add_argument("--cameras", default="", metavar="NAMES",
                        help="comma-separated cameras to record at every step (`python -m benchmarks` lists "
                             "each suite's); default: none, state only")
    parser.add_argument("--image-size", type=int, default=None, metavar="N",
                        help="record N × N frames (default: each camera's default size)")
    parser.add_argument("--image-dtype", choices=IMAGE_DTYPES, default="video",
                        help="video: LeRobot v3 AV1 mp4 per camera (default); image: a PNG per frame")
    parser.add_argument("--action-noise", type=float, default=0.0, metavar="SIGMA",
                        help="play the expert's action plus N(0, SIGMA × half the action range), record the "
                             "clean action (DART; default 0: no noise)")


@dataclass
class Attempt:
    """The outcome of one expert episode."""

    task: str
    seed: int
    success: bool
    length: int


@dataclass
class TaskReport:
    """How the expert did on one task, over every attempt recorded so far."""

    task: str
    attempts: int
    successes: int
    kept: int
    mean_length: float  # over kept episodes

    @property
    def success_rate(self) -> float:
        return self.successes / self.attempts if self.attempts else 0.0


@dataclass
class CollectionReport:
    """What a collect-demos run produced."""

    suite: str
    out: Path
    episodes_per_task: int
    tasks: list[TaskReport] = field(default_factory=list)
    new_attempts: int = 0  # episodes played by this run (0 when resuming a finished one)
    rewritten: bool = False  # whether data/ and meta/ were (re)written by this run

    @property
    def episodes(self) -> int:
        return sum(t.kept for t in self.tasks)

    @property
    def short_tasks(self) -> list[str]:
        return [t.task for t in self.tasks if t.kept < self.episodes_per_task]


def run(args: argparse.Namespace) -> CollectionReport:
    try:
        cameras = [c.strip() for c in args.cameras.split(",") if c.strip()]
        report = collect_demos(args.suite, args.out, args.episodes_per_task, seed=args.seed,
                               workers=args.workers, max_attempts=args.max_attempts, cameras=cameras,
                               image_size=args.image_size, image_dtype=args.image_dtype,
                               action_noise=args.action_noise)
    except (SuiteError, CollectionError) as e:
        raise SystemExit(f"trainer collect-demos: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit(f"trainer collect-demos: interrupted; finished episodes are saved in "
                         f"{work_dir(args.out)} — re-run the same command to resume") from None
    return report


class CollectionError(ValueError):
    """Arguments or an output directory that collect-demos cannot work with."""


def collect_demos(
    suite_name: str,
    out: Path | str,
    episodes_per_task: int,
    *,
    seed: int = 0,
    workers: int | None = None,
    max_attempts: int | None = None,
    cameras: Sequence[str] = (),
    image_size: int | None = None,
    image_dtype: str = "video",
    action_noise: float = 0.0,
    show_progress: bool = True,
) -> CollectionReport:
    """Collect, resume or extend a demonstration dataset; see the module docstring.

    ``cameras`` names the cameras to record (``image_size``: N × N frames, else each
    camera's default size), stored as ``image_dtype`` "video" or "image";
    ``action_noise`` is the DART noise (a fraction of the action half-range).
    """
    from rich.console import Console

    out = Path(out)
    suite = get_suite(suite_name)
    n = episodes_per_task
    if n < 1:
        raise CollectionError(f"--episodes-per-task must be at least 1, got {n}")
    max_attempts = max_attempts if max_attempts is not None else max(2 * n, n + 10)
    if max_attempts < n:
        raise CollectionError(f"--max-attempts {max_attempts} is below --episodes-per-task {n}; "
                              "allow at least as many attempts as episodes")
    if seed < 0 or seed + max_attempts > EVAL_SEED_START:
        raise CollectionError(
            f"--seed {seed} with up to {max_attempts} attempts per task would use seeds up to "
            f"{seed + max_attempts - 1}; demo seeds must lie in [0, {EVAL_SEED_START:,}) because evaluation "
            f"seeds start at {EVAL_SEED_START:,}; pick --seed below {EVAL_SEED_START - max_attempts:,}")
    try:
        suite.expert(suite.task_names[0])
    except NoExpertError as e:
        raise CollectionError(f"--suite {suite.name}: {e}") from None
    workers = workers or _usable_cores()
    if workers < 1:
        raise CollectionError(f"--workers must be at least 1, got {workers}")
    if image_dtype not in IMAGE_DTYPES:
        raise CollectionError(f"--image-dtype {image_dtype!r}: choose one of {', '.join(IMAGE_DTYPES)}")
    if cameras and suite.fps != int(suite.fps):
        raise CollectionError(f"--suite {suite.name} runs at {suite.fps} steps/s; videos need a whole frame rate")
    sizes = suite.resolve_cameras({c: (image_size, image_size) for c in cameras} if image_size else list(cameras))
    if image_size is not None and not cameras:
        raise CollectionError("--image-size needs --cameras (which cameras to record at that size)")
    if not (0.0 <= action_noise <= 1.0):
        raise CollectionError(f"--action-noise {action_noise}: give a fraction of the action half-range in [0, 1]")
    recording = Recording(cameras=sizes, image_dtype=image_dtype if sizes else None, action_noise=action_noise)

    work = _prepare_out(out, suite, seed, recording)
    console = Console(stderr=True, quiet=not show_progress)
    records = {task: _load_attempts(work, task) for task in suite.task_names}
    new_attempts = _play_missing(suite, work, records, n, seed, max_attempts, workers, console, recording)

    selection = {task: [s for s in sorted(records[task])
                        if seed <= s < seed + max_attempts and records[task][s].success][:n]
                 for task in suite.task_names}
    reports = [_task_report(task, records[task], selection[task], seed, max_attempts)
               for task in suite.task_names]
    report = CollectionReport(suite=suite.name, out=out, episodes_per_task=n, tasks=reports,
                              new_attempts=new_attempts)
    if report.episodes == 0:
        raise CollectionError(f"the {suite.name} expert succeeded in none of its attempts; nothing to write")
    report.rewritten = _write_if_changed(out, work, suite, selection, reports, seed, n, max_attempts, recording)
    _print_report(console, report)
    return report


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Recording:
    """How each episode is played and what it records besides state and action.

    Cameras (name → (height, width)), their dtype, and the DART noise on the played actions.
    """

    cameras: dict[str, tuple[int, int]]
    image_dtype: str | None  # "video" or "image"; None without cameras
    action_noise: float = 0.0

    def to_json(self) -> dict[str, Any]:
        # no noise is left out, so collections from before the option keep their identity
        noise = {"action_noise": self.action_noise} if self.action_noise else {}
        return {"cameras": {name: list(size) for name, size in self.cameras.items()},
                "image_dtype": self.image_dtype, **noise}


def work_dir(out: Path | str) -> Path:
    """The work folder of the collection whose dataset is ``out``: ``OUT.collect`` beside it."""
    out = Path(out)
    return out.with_name(out.name + WORK_SUFFIX)


def _prepare_out(out: Path, suite: Suite, seed: int, recording: Recording) -> Path:
    """Create OUT.collect (or check that an existing one belongs to this suite, seed and recording)."""
    work = work_dir(out)
    old = out / OLD_WORK_DIR
    if old.is_dir() and not work.exists():
        os.replace(old, work)  # a collection from before the work folder moved out of the dataset
    run_file = work / RUN_FILE
    this_run = {"format": RUN_FORMAT, "suite": suite.name, "seed": seed, **recording.to_json()}
    if run_file.is_file():
        previous = json.loads(run_file.read_text())
        previous_recording = {"cameras": previous.get("cameras", {}), "image_dtype": previous.get("image_dtype")}
        if previous.get("action_noise"):
            previous_recording["action_noise"] = previous["action_noise"]
        if (previous.get("suite"), previous.get("seed")) != (suite.name, seed):
            raise CollectionError(
                f"--out {out} holds a collection for suite {previous.get('suite')} from seed "
                f"{previous.get('seed')}; this run asks for suite {suite.name} from seed {seed}. "
                "Use the same --suite and --seed to resume, or another --out")
        if previous_recording != recording.to_json():
            raise CollectionError(
                f"--out {out} holds a collection recording {_describe(previous_recording)}; this run asks for "
                f"{_describe(recording.to_json())}. Use the same --cameras, --image-size, --image-dtype and "
                "--action-noise to resume, or another --out")
        if previous != this_run:
            run_file.write_text(json.dumps(this_run) + "\n")  # format 1 → 2: same collection, new fields
    elif out.exists() and any(out.iterdir()):
        raise CollectionError(f"--out {out} exists, is not empty and was not written by collect-demos (no "
                              f"{work}); choose a new directory")
    else:
        work.mkdir(parents=True, exist_ok=True)
        run_file.write_text(json.dumps(this_run) + "\n")
    return work


def _describe(recording: Mapping[str, Any]) -> str:
    cameras = recording.get("cameras") or {}
    noise = f" with action noise {recording['action_noise']}" if recording.get("action_noise") else ""
    if not cameras:
        return "no cameras" + noise
    sizes = ", ".join(f"{name} {h}x{w}" for name, (h, w) in cameras.items())
    return f"cameras {sizes} as {recording.get('image_dtype')}{noise}"


def _shard_path(work: Path, task: str, seed: int) -> Path:
    return work / task / f"seed-{seed:07d}.npz"


def _load_attempts(work: Path, task: str) -> dict[int, Attempt]:
    """The attempts already saved for ``task``; an unreadable file is removed and replayed."""
    attempts: dict[int, Attempt] = {}
    for path in sorted((work / task).glob("seed-*.npz")):
        try:
            seed = int(path.stem.removeprefix("seed-"))
            with np.load(path) as shard:
                attempts[seed] = Attempt(task, seed, bool(shard["success"]), int(shard["length"]))
        except (OSError, ValueError, KeyError):
            path.unlink(missing_ok=True)
    return attempts


def _plan(records: dict[int, Attempt], in_flight: set[int], n: int, seed: int, max_attempts: int) -> list[int]:
    """Seeds to start now so that, if all succeed, the task has its n episodes.

    Walks seeds in order, counting recorded successes and in-flight attempts as
    (potential) successes; a seed is started only if the seeds before it cannot
    already yield n. The attempted seeds therefore always end up as the shortest
    prefix of S, S+1, ... holding n successes, however the work was interleaved.
    """
    count = 0
    start: list[int] = []
    for k in range(seed, seed + max_attempts):
        if count >= n:
            break
        if k in records:
            count += records[k].success
        else:
            if k not in in_flight:
                start.append(k)
            count += 1
    return start


def _play_missing(suite: Suite, work: Path, records: dict[str, dict[int, Attempt]], n: int, seed: int,
                  max_attempts: int, workers: int, console: Any, recording: Recording) -> int:
    """Play every episode still needed, updating ``records``; return how many were played."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    in_flight: dict[str, set[int]] = {task: set() for task in suite.task_names}
    jobs: deque[tuple[str, int]] = deque()
    for task in suite.task_names:
        for k in _plan(records[task], in_flight[task], n, seed, max_attempts):
            in_flight[task].add(k)
            jobs.append((task, k))
    if not jobs:
        return 0

    def kept() -> int:
        return sum(min(n, sum(a.success for s, a in r.items() if seed <= s < seed + max_attempts))
                   for r in records.values())

    played = 0
    failures = 0
    progress = Progress(TextColumn(f"[bold]{suite.name}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("episodes · {task.fields[played]} played, {task.fields[failed]} failed"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
    submit: Callable[[str, int], Future]
    pool: ProcessPoolExecutor | None = None
    if workers > 1 and len(jobs) > 1:
        # spawn, not fork: the parent runs rich's refresh thread, and forking a threaded
        # process (or one holding MuJoCo state) is how deadlocks happen.
        pool = ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=get_context("spawn"))

        def submit(task: str, k: int) -> Future:
            return pool.submit(play_episode, suite.name, task, k, str(_shard_path(work, task, k)), recording)
    else:
        def submit(task: str, k: int) -> Future:
            # Run in this process, when the loop asks for the result (a Future already done).
            future: Future = Future()
            try:
                future.set_result(play_episode(suite.name, task, k, str(_shard_path(work, task, k)), recording))
            except Exception as e:
                future.set_exception(e)
            return future

    pending: dict[Future, tuple[str, int]] = {}
    try:
        with progress:
            bar = progress.add_task("collect", total=n * len(suite.task_names), completed=kept(),
                                    played=0, failed=0)

            def fill() -> None:
                # The in-process runner plays one episode per call so the bar moves as it goes.
                while jobs and (pool is not None or not pending):
                    task, k = jobs.popleft()
                    pending[submit(task, k)] = (task, k)

            fill()
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for future in done:
                    task, k = pending.pop(future)
                    in_flight[task].discard(k)
                    try:
                        attempt = future.result()
                    except Exception as e:
                        raise RuntimeError(f"{suite.name}/{task} seed {k}: the episode failed: {e!r}") from e
                    records[task][k] = attempt
                    played += 1
                    failures += not attempt.success
                    for k2 in _plan(records[task], in_flight[task], n, seed, max_attempts):
                        in_flight[task].add(k2)
                        jobs.append((task, k2))
                    progress.update(bar, completed=kept(), played=played, failed=failures)
                fill()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return played


_WORKER_ENVS: OrderedDict[tuple[str, str], tuple[Any, Any]] = OrderedDict()


def _action_noise(suite: Suite, task: str, seed: int, sigma: float) -> Callable[[np.ndarray], np.ndarray] | None:
    """The DART perturbation of one episode (seeded by its task and seed), or None without noise."""
    if not sigma:
        return None
    low, high = suite.action_low_array, suite.action_high_array
    scale = sigma * (high - low) / 2
    # not the simulator's default_rng([crc32(task), seed]) (metaworld._task_rng), which draws the initial
    # state: the noise must be a stream of its own
    task_key = int.from_bytes(hashlib.sha256(task.encode()).digest()[:8], "little")
    rng = np.random.default_rng([task_key, seed])

    def perturb(action: np.ndarray) -> np.ndarray:
        return np.clip(action + rng.normal(size=action.shape) * scale, low, high).astype(action.dtype)

    return perturb


def play_episode(suite_name: str, task: str, seed: int, shard: str,
                 recording: Recording = Recording({}, None)) -> Attempt:
    """Play one expert episode and save it to ``shard`` (atomically); runs in a worker process.

    With cameras, the frames seen before each action are rendered, and a successful
    episode's are encoded here (``CameraFrames.encode``, one encoder thread).
    """
    key = (suite_name, task)
    if key in _WORKER_ENVS:
        _WORKER_ENVS.move_to_end(key)
    else:
        suite = get_suite(suite_name)
        _WORKER_ENVS[key] = (suite.make_env(task, seed), suite.expert(task))
        if len(_WORKER_ENVS) > ENVS_PER_WORKER:
            _WORKER_ENVS.popitem(last=False)[1][0].close()
    env, expert = _WORKER_ENVS[key]
    noise = _action_noise(env.suite, task, seed, recording.action_noise)

    obs = env.reset(seed)
    states: list[np.ndarray] = []
    actions: list[np.ndarray] = []
    rewards: list[float] = []
    frames: dict[str, list[np.ndarray]] = {camera: [] for camera in recording.cameras}
    hidden: list[np.ndarray] = []  # what a pixel suite hides from the policy (its goal), per frame
    hidden_names: tuple[str, ...] = ()
    while True:
        if (withheld := env.hidden_state()) is not None:
            hidden_names = withheld[0]
            hidden.append(withheld[1])
        if recording.cameras:
            for camera, image in env.render_images(recording.cameras).items():
                frames[camera].append(image)
        clean = expert(env.expert_observation())
        result = env.step(clean if noise is None else noise(clean))
        states.append(obs["state"])
        # the clipped action the simulator applied, or with noise the expert's own (clipped) action
        actions.append(result.info["action"] if noise is None else clean)
        rewards.append(result.reward)
        obs = result.obs
        if result.done:
            break
    attempt = Attempt(task, seed, result.success, len(states))
    # Failed episodes keep only their outcome: they are counted, never trained on.
    arrays: dict[str, np.ndarray] = {"success": np.bool_(attempt.success), "length": np.int64(attempt.length)}
    if attempt.success:
        arrays |= {"state": np.stack(states), "action": np.stack(actions), "reward": np.asarray(rewards, np.float32)}
        if hidden:
            arrays |= {"environment_state": np.stack(hidden), "environment_state_names": np.array(hidden_names)}
        fps = int(env.suite.fps)
        for camera, images in frames.items():
            encoded = CameraFrames.encode(np.stack(images), fps=fps, dtype=recording.image_dtype or "video")
            arrays |= camera_arrays(camera, encoded)
    else:
        arrays |= {"state": np.zeros((0, 0), np.float32), "action": np.zeros((0, 0), np.float32),
                   "reward": np.zeros(0, np.float32)}
    path = Path(shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)
    return attempt


def _camera_frames(shard: Any, camera: str, path: Path) -> CameraFrames:
    frames = camera_frames(shard, camera)
    if frames is None:
        raise CollectionError(f"{path}: no frames of camera {camera}; the episode was recorded without it — "
                              "delete the file to replay it")
    return frames


def _task_report(task: str, records: dict[int, Attempt], kept: list[int], seed: int,
                 max_attempts: int) -> TaskReport:
    tried = [a for s, a in records.items() if seed <= s < seed + max_attempts]
    lengths = [records[s].length for s in kept]
    return TaskReport(task=task, attempts=len(tried), successes=sum(a.success for a in tried), kept=len(kept),
                      mean_length=float(np.mean(lengths)) if lengths else 0.0)


def _write_if_changed(out: Path, work: Path, suite: Suite, selection: dict[str, list[int]],
                      reports: list[TaskReport], seed: int, n: int, max_attempts: int, recording: Recording) -> bool:
    """Rebuild data/, meta/ and videos/ from the saved episodes unless they already hold this selection."""
    digest = hashlib.sha256(json.dumps(
        {"suite": suite.name, "fps": suite.fps, "layout": DATASET_LAYOUT, **recording.to_json(),
         "episodes": [[t, s] for t in suite.task_names for s in selection[t]]},
        sort_keys=True).encode()).hexdigest()
    if (out / "meta" / "info.json").is_file() and (out / EVALFORGE_PATH).is_file():
        try:
            if json.loads((out / EVALFORGE_PATH).read_text()).get("selection_sha256") == digest:
                return False
        except json.JSONDecodeError:
            pass  # a damaged evalforge.json: rewrite below

    episodes: list[Episode] = []
    hidden_names: tuple[str, ...] = ()
    for task in suite.task_names:
        for s in selection[task]:
            path = _shard_path(work, task, s)
            with np.load(path) as shard:
                episodes.append(Episode(task=task, state=shard["state"], action=shard["action"],
                                        reward=shard["reward"], success=True, seed=s,
                                        cameras={c: _camera_frames(shard, c, path) for c in recording.cameras},
                                        environment_state=shard["environment_state"]
                                        if "environment_state" in shard else None))
                if "environment_state_names" in shard:
                    hidden_names = tuple(str(n) for n in shard["environment_state_names"])
    # the hidden state goes in only when every episode has it (shards saved before it was recorded have none)
    if any(ep.environment_state is None for ep in episodes):
        for ep in episodes:
            ep.environment_state = None
    write_dataset(
        out, episodes, fps=suite.fps, tasks={t.name: t.instruction for t in suite.tasks},
        state_names=suite.state_names, action_names=suite.action_names,
        environment_state_names=hidden_names if episodes[0].environment_state is not None else (),
        robot_type=suite.simulator,
        extra_info={
            "suite": suite.name,
            "created_by": "trainer collect-demos",
            "seed_start": seed,
            "episodes_per_task": n,
            "max_attempts": max_attempts,
            "eval_seed_start": EVAL_SEED_START,
            **recording.to_json(),
            "expert": {r.task: {"attempts": r.attempts, "successes": r.successes} for r in reports},
            "selection_sha256": digest,
        },
    )
    return True


def _print_report(console: Any, report: CollectionReport) -> None:
    from rich.table import Table

    table = Table(title=f"{report.suite}: scripted expert", title_justify="left")
    table.add_column("task", no_wrap=True, min_width=max(len(t.task) for t in report.tasks))
    for name in ("attempts", "successes", "rate", "kept", "mean len"):
        table.add_column(name, justify="right")
    for t in report.tasks:
        style = "yellow" if t.kept < report.episodes_per_task else None
        table.add_row(t.task, str(t.attempts), str(t.successes), f"{t.success_rate:.0%}", str(t.kept),
                      f"{t.mean_length:.0f}", style=style)
    attempts = sum(t.attempts for t in report.tasks)
    successes = sum(t.successes for t in report.tasks)
    table.add_row("all", str(attempts), str(successes), f"{successes / max(attempts, 1):.0%}",
                  str(report.episodes), "", style="bold")
    console.print(table)
    what = "wrote" if report.rewritten else "already complete:"
    console.print(f"{what} {report.out} — {report.episodes} episodes ({report.new_attempts} played this run)")
    if report.short_tasks:
        console.print(f"[yellow]fewer than {report.episodes_per_task} episodes for: "
                      f"{', '.join(report.short_tasks)} (raise --max-attempts to try more seeds)")

