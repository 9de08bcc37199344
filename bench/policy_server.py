"""Policy-server benchmark: our server against the raw vLLM engine and a one-at-a-time server.

For two state policy sizes (about 1 M and 25 M parameters; 39-dim state, 4-dim actions,
chunk 4), and a vision policy (``--sizes vision``: ``trainer init-policy --vision``
shaped like configs/vla-reach-pixels.yaml — one 64×64 ``corner`` camera, patch 16 →
16 image rows, encoder width 128 × 2 layers, the 1m decoder, 36-dim state of
metaworld-mt1-reach-pixels, 64 bins), at 1, 8, 32 and 64 concurrent clients, in one run:

- raw: vLLM ``AsyncLLM`` driven directly in this process, same prompts and
  sampling parameters — the ceiling. For the vision policy, the raw engine gets the
  mixed token/embedding prompts the server would build (``VllmEngine.engine_input``
  with the vision tower's rows for the same images), made once up front: no
  encoder, no codec, no event loop of the server's in its way;
- raw + encoder (vision only): the same raw engine, but each request first waits for its
  image rows from the policy's ``BatchedVisionEncoder`` running in this process, as a
  caller driving vLLM directly with this policy must. Not the ceiling: server / this side
  is what the serving layer itself costs, apart from the encoder's compute;
- server: ``policy-server`` (vLLM engine) over WebSocket, one connection per client;
- one-at-a-time: ``policy-server --engine hf`` over WebSocket, the openpi design.

Every client of the vision policy sends its ``corner`` image in each observation
(uint8 64×64×3); the server decodes it, preprocesses it, encodes it with the other
requests of its scheduling window (``BatchedVisionEncoder``) and hands vLLM the mixed
prompt. Each side's mean engine batch size (running requests per engine step, from
vLLM's scheduler stats: the raw engine's own, the server's ``/metrics`` histogram) and
the server's encoder wait (``timing["encoder_ms"]``) are printed in a second table, and
the CPU time per finished request of each side's processes (this process, the serving
process and its encoder's share, vLLM's engine core, its workers) in a third: on a small
CPU host every millisecond the serving process spends is one vLLM's engine core may miss.

Raw and server run at once, one policy size at a time, and each concurrency level
is measured in ``--rounds`` rounds of windows taken in turns — raw with vLLM's
engine-core process where vLLM leaves it (every core), raw with it on its
worker's compute cores (``policy-server --engine-core compute``), server; the
better raw placement is the ceiling — so a machine whose speed drifts (a shared
VM: the raw engine alone varied by 40% between runs an hour apart) moves every
side alike. The idle
sides' vLLM processes stop polling within a second, and each window starts after
a pause longer than that. The one-at-a-time server runs afterwards, alone. Each
window runs closed-loop clients for ``--seconds``; requests/s, actions/s
(requests × chunk) and p50/p99 latency pool the windows. ``--sweep`` also
measures what the engine settings change (thread binding, KV-cache space,
compilation, max batched tokens) on the raw engine at 32 in flight, one fresh
process each, one after another.

    .venv/bin/python bench/policy_server.py [--seconds 4] [--rounds 3] [--sizes 1m,25m,vision] [--sweep]
    .venv/bin/python bench/policy_server.py --sizes vision --no-one-at-a-time   # the vision policy only
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_format import load_checkpoint  # noqa: E402
from services.policy_server.engines import EngineSettings, VllmEngine, pin_threads  # noqa: E402
from services.protocol.client import AsyncPolicyClient, ClientSettings  # noqa: E402
from services.supervisor import PolicyServerProcess  # noqa: E402
from trainer.cli import main as trainer_main  # noqa: E402

CONCURRENCY = (1, 8, 32, 64)
SETTLE_S = 1.5  # vLLM's idle processes poll their queues for 1 s after the last message
# Where the raw engine's vLLM engine-core process runs: "anywhere" (where vLLM leaves it, as
# policy-server does by default) or "compute" (its worker's cores: policy-server --engine-core compute,
# what evalforge up uses next to simulators). The better of the two is the ceiling.
RAW_PLACEMENTS = {"raw, engine core anywhere": "anywhere", "raw, engine core on compute cores": "compute"}
# A vision policy's third raw side: the raw engine with the policy's encoder run in this process for
# every request (the server's BatchedVisionEncoder, on its own thread), its engine core where vLLM
# leaves it, as the server's is. It is not the ceiling (raw is): it is what a caller driving vLLM
# directly with this policy pays, so server / this side is the serving layer's own cost.
RAW_ENCODING = "raw + encoder, engine core anywhere"
STATE_DIM, ACTION_DIM, CHUNK = 39, 4, 4
TASKS = "reach-v3,push-v3,pick-place-v3"
# The vision policy: configs/vla-reach-pixels.yaml's shape (random weights: throughput does not depend on them).
VISION_SUITE, VISION_CAMERA, VISION_IMAGE = "metaworld-mt1-reach-pixels", "corner", 64
VISION_POLICY = ["--suite", VISION_SUITE, "--cameras", VISION_CAMERA, "--image-size", str(VISION_IMAGE), "--vision",
                 "--patch-size", "16", "--vision-width", "128", "--vision-layers", "2", "--vision-heads", "2",
                 "--preset", "1m", "--bins", "64", "--chunk-size", str(CHUNK)]
OBSERVATIONS = 256  # distinct observations (state, task, images) each side cycles through


@dataclass
class Window:
    """One closed-loop window: requests finished inside it and latencies of those that ran wholly in it."""

    completed: int
    latencies: list[float]
    seconds: float
    batch: tuple[float, float] = (0.0, 0.0)  # (sum, count) of the engine's batch sizes during the window
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds of each process role during the window


@dataclass
class Cell:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    engine_p50_ms: float | None = None  # time inside the server's engine, from the reply's timing
    batch_mean: float | None = None  # mean running requests per engine step
    encoder_p50_ms: float | None = None  # a vision request's wait for its image rows, from the reply's timing
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU ms per finished request, by process role

    @property
    def actions_per_s(self) -> float:
        return self.requests_per_s * CHUNK

    @classmethod
    def pool(cls, windows: list[Window], engine_ms: list[float] | None = None,
             encoder_ms: list[float] | None = None) -> Cell:
        completed = sum(w.completed for w in windows)
        seconds = sum(w.seconds for w in windows)
        latencies = [x for w in windows for x in w.latencies]
        engine_p50 = float(np.median(engine_ms)) if engine_ms else None
        steps = sum(w.batch[1] for w in windows)
        batch = sum(w.batch[0] for w in windows) / steps if steps else None
        encoder_p50 = float(np.median(encoder_ms)) if encoder_ms else None
        roles = {role for w in windows for role in w.cpu}
        cpu_ms = {role: 1e3 * sum(w.cpu.get(role, 0.0) for w in windows) / max(completed, 1) for role in roles}
        if not latencies:
            return cls(completed / seconds, float("inf"), float("inf"), engine_p50, batch, encoder_p50, cpu_ms)
        lat = np.asarray(latencies) * 1e3
        return cls(completed / seconds, float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), engine_p50,
                   batch, encoder_p50, cpu_ms)


def _states(n: int, dim: int = STATE_DIM) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.uniform(-1, 1, dim).astype(np.float32) for _ in range(n)]


def _images(n: int, cameras: dict[str, tuple[int, int]]) -> list[dict[str, np.ndarray]]:
    """``n`` observations' camera frames (uint8 noise: throughput does not depend on the pixels)."""
    rng = np.random.default_rng(1)
    return [{name: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for name, (h, w) in cameras.items()}
            for _ in range(n)]


def metric_values(metrics_url: str, *names: str) -> list[float]:
    """The samples ``names`` of a policy server's ``/metrics`` (0 where absent), from one read."""
    text = httpx.get(metrics_url, timeout=10).text
    matches = (re.search(rf"^{name}\S* (\S+)$", text, re.MULTILINE) for name in names)
    return [float(match.group(1)) if match else 0.0 for match in matches]


def histogram(metrics_url: str, name: str) -> tuple[float, float]:
    """(sum, count) of one histogram of a policy server's ``/metrics``."""
    total, count = metric_values(metrics_url, f"{name}_sum", f"{name}_count")
    return total, count


async def _closed_loop(worker, concurrency: int, seconds: float) -> Window:
    """Run ``concurrency`` loops of ``worker(i)`` for ``seconds`` after a short warm-up.

    Every request that finished inside the window counts, so a server slower than
    the window per queued request (one-at-a-time at high concurrency) still gets its
    true rate; latencies come from the requests that started and finished inside it.
    """
    latencies: list[float] = []
    completed = 0
    stop_at = 0.0
    warm_until = time.perf_counter() + min(1.0, seconds / 4)

    async def loop(i: int) -> None:
        nonlocal completed
        while True:
            start = time.perf_counter()
            if start >= stop_at and stop_at:
                return
            await worker(i)
            end = time.perf_counter()
            if warm_until <= end <= stop_at:
                completed += 1
                if start >= warm_until:
                    latencies.append(end - start)

    stop_at = warm_until + seconds
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    return Window(completed, latencies, seconds)


def place_engine_core(owner: psutil.Process, where: str) -> None:
    """Put the vLLM engine-core process started by ``owner`` on its worker's cores ("compute", as
    ``policy-server --engine-core compute`` does) or on every core ("anywhere", where vLLM leaves it)."""
    for engine_core in owner.children():
        if "EngineCore" not in engine_core.name():
            continue
        workers = [p for p in engine_core.children() if "Worker" in p.name()]
        if not workers:
            return  # --executor uni: the engine core is the compute process; its threads stay bound
        everything = set(range(os.cpu_count() or 1))
        compute = set(workers[0].cpu_affinity())
        pin_threads(engine_core, compute if where == "compute" else everything)


# Who spends the CPU time of a window, per side (CPU_ROLES): this process (the clients, and for raw
# the engine's front end), the policy server's process (its event loop, vLLM's front end, the vision
# encoder; "encoder" is the encoder's share, from its /metrics counter), vLLM's engine-core process
# (the scheduler) and its worker processes (the model).
CPU_ROLES = ("benchmark process", "serving process", "of which encoder", "engine core", "workers")


def process_roles(owner: psutil.Process, skip: set[int] = frozenset()) -> dict[str, list[psutil.Process]]:
    """``owner`` and its vLLM processes by role (children whose pid is in ``skip`` left out)."""
    roles: dict[str, list[psutil.Process]] = {"owner": [owner], "engine core": [], "workers": []}
    for child in owner.children(recursive=True):
        if child.pid in skip or any(p.pid in skip for p in child.parents()):
            continue
        name = child.name()
        if "EngineCore" in name:
            roles["engine core"].append(child)
        elif "Worker" in name:
            roles["workers"].append(child)
    return roles


def cpu_seconds(roles: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """User + system CPU seconds so far of each role's processes."""
    out = {}
    for role, procs in roles.items():
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                continue
        out[role] = total
    return out


class RawEngine:
    """vLLM ``AsyncLLM`` driven in this process with the server's prompts and sampling parameters.

    A vision policy's prompts are the server's mixed token/embedding prompts for the same
    observations the clients send, built once up front (its vision tower's rows through
    ``VllmEngine.engine_input``), so the raw side pays for no encoder."""

    def __init__(self, checkpoint: Path, settings: EngineSettings) -> None:
        self.spec = load_checkpoint(checkpoint)
        self.engine = VllmEngine(self.spec, settings)
        tokenizer = self.spec.tokenizer
        tasks = tokenizer.tasks
        self.prompts = [tokenizer.prompt(tasks[i % len(tasks)], s)
                        for i, s in enumerate(_states(OBSERVATIONS, tokenizer.state_dim))]
        self.prepared: list[object] | None = None
        self.pixels: list[np.ndarray] = []  # a vision policy's model inputs per observation (RAW_ENCODING)
        self.encoder = None  # its BatchedVisionEncoder, alive for RAW_ENCODING's windows
        self.batch = [0.0, 0.0]  # (sum, count) of the engine's batch sizes
        self.engine.on_batch = self._count_batch
        self.ids = itertools.count()

    def _count_batch(self, running: int) -> None:
        self.batch[0] += running
        self.batch[1] += 1

    async def start(self) -> RawEngine:
        await self.engine.start()
        if self.spec.card.vision is not None:
            from policy_format import pixel_values
            from services.policy_server.vision import BatchedVisionEncoder, load_vision_tower

            self.encoder = BatchedVisionEncoder(load_vision_tower(self.spec))
            cameras = self.spec.card.cameras
            self.pixels = [pixel_values(images, cameras) for images in _images(OBSERVATIONS, self.spec.card.camera_sizes)]
            rows = [self.encoder.forward(p).flatten(0, 1) for p in self.pixels]  # what encode() hands a request
            self.prepared = [self.engine.engine_input(p, r) for p, r in zip(self.prompts, rows, strict=True)]
        await self.request(0)
        return self

    async def request(self, i: int) -> None:
        params = self.engine.sampling_params(0.0, None)
        k = i % len(self.prompts)
        prompt = self.prepared[k] if self.prepared is not None else self.engine.engine_input(self.prompts[k])
        async for _ in self.engine.llm.generate(prompt, params, request_id=f"raw-{next(self.ids)}"):
            pass

    async def request_encoding(self, i: int) -> None:
        """One request of RAW_ENCODING: the observation's rows from the encoder, then the engine."""
        params = self.engine.sampling_params(0.0, None)
        k = i % len(self.prompts)
        rows = await self.encoder.encode(self.pixels[k])
        async for _ in self.engine.llm.generate(self.engine.engine_input(self.prompts[k], rows), params,
                                                request_id=f"raw-{next(self.ids)}"):
            pass

    async def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
        await self.engine.close()


class ServerClients:
    """``concurrency`` WebSocket clients of one policy server, each with its own observation."""

    def __init__(self, server: PolicyServerProcess, concurrency: int) -> None:
        self.clients = [AsyncPolicyClient(server.ws_url, ClientSettings(call_timeout_s=300))
                        for _ in range(concurrency)]
        self.metrics_url = server.ws_url.replace("ws://", "http://").removesuffix("/ws") + "/metrics"
        self.observations: list[dict] = []
        self.engine_ms: list[float] = []
        self.encoder_ms: list[float] = []

    async def __aenter__(self) -> ServerClients:
        metadata = await asyncio.gather(*(c.connect() for c in self.clients))
        # The observations the raw engine's prompts are made of: same states, tasks and images.
        tasks, cameras = list(metadata[0].tasks), dict(metadata[0].cameras)
        states = _states(OBSERVATIONS, metadata[0].state_dim)
        images = _images(OBSERVATIONS, cameras) if cameras else [{}] * OBSERVATIONS
        self.observations = [{"state": s, "task": tasks[i % len(tasks)], **({"images": im} if im else {})}
                             for i, (s, im) in enumerate(zip(states, images, strict=True))]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def request(self, i: int) -> None:
        reply = await self.clients[i].infer(self.observations[i % len(self.observations)])
        self.engine_ms.append(reply.timing["engine_ms"])
        if "encoder_ms" in reply.timing:
            self.encoder_ms.append(reply.timing["encoder_ms"])

    def batch(self) -> tuple[float, float]:
        return histogram(self.metrics_url, "evalforge_policy_engine_batch_size")


def _side_cpu(side: str, roles: dict[str, list[psutil.Process]], bench_only: dict[str, list[psutil.Process]],
              clients: ServerClients, raw: RawEngine) -> dict[str, float]:
    """CPU seconds so far of one side's processes, by CPU_ROLES."""
    cpu = cpu_seconds(roles)
    if side != "server":  # raw: its front end (and RAW_ENCODING's encoder) is this process
        out = {"benchmark process": cpu["owner"], "engine core": cpu["engine core"], "workers": cpu["workers"]}
        if side == RAW_ENCODING:
            out["of which encoder"] = raw.encoder.cpu_seconds
        return out
    [encoder] = metric_values(clients.metrics_url, "evalforge_policy_encoder_cpu_seconds_total")
    return {"benchmark process": cpu_seconds(bench_only)["owner"], "serving process": cpu["owner"],
            "of which encoder": encoder, "engine core": cpu["engine core"], "workers": cpu["workers"]}


async def bench_raw(checkpoint: Path, seconds: float, settings: EngineSettings,
                    concurrency: tuple[int, ...] = CONCURRENCY) -> dict[int, Cell]:
    """The raw engine alone (used by ``--sweep``)."""
    raw = await RawEngine(checkpoint, settings).start()
    try:
        gc.collect()
        gc.freeze()  # as the server does after warm-up
        return {c: Cell.pool([await _closed_loop(raw.request, c, seconds)]) for c in concurrency}
    finally:
        await raw.close()


def _server_args(settings: EngineSettings) -> list[str]:
    """CLI flags giving a policy-server the same engine settings as the raw run."""
    args = ["--kv-cache-gib", f"{settings.kv_cache_gib:g}", "--max-num-seqs", str(settings.max_num_seqs)]
    if settings.executor:
        args += ["--executor", settings.executor]
    args += ["--engine-core", "compute" if settings.engine_core_on_compute_cores else "vllm"]
    if settings.omp_threads_bind:
        args += ["--omp-threads-bind", settings.omp_threads_bind]
    if not settings.enforce_eager:
        args.append("--compile")
    return args


async def compare(checkpoint: Path, settings: EngineSettings, levels: tuple[int, ...], seconds: float,
                  rounds: int, one_at_a_time: bool = True) -> dict[str, dict[int, Cell]]:
    """Raw engine (both placements of its engine core) and server on one checkpoint, their windows in
    turns; then the one-at-a-time server alone. ``raw`` is the better raw placement per concurrency."""
    out: dict[str, dict[int, Cell]] = {name: {} for name in (*RAW_PLACEMENTS, RAW_ENCODING, "server", "raw", "hf")}
    # The server starts first, from this process while it still has every core (the
    # raw engine moves this process onto the serving cores, and children inherit that).
    with PolicyServerProcess(checkpoint, "--log-level", "warning", *_server_args(settings)) as server:
        raw = await RawEngine(checkpoint, settings).start()
        gc.collect()
        gc.freeze()  # as the server does after warm-up; keeps collections off the imported heap
        # From here this process (raw engine's front end and every benchmark client) is
        # on the serving cores, as the server's own process is; vLLM's compute cores
        # belong to the engines, which never run at the same time.
        server_proc = psutil.Process(server.proc.pid)
        server_roles = process_roles(server_proc)
        raw_roles = process_roles(psutil.Process(), skip={server_proc.pid})
        bench_only = {"owner": raw_roles["owner"]}
        try:
            for c in levels:
                sides = [*RAW_PLACEMENTS, *([RAW_ENCODING] if raw.encoder is not None else []), "server"]
                windows: dict[str, list[Window]] = {name: [] for name in sides}
                async with ServerClients(server, c) as clients:
                    await clients.request(0)
                    clients.engine_ms.clear()
                    clients.encoder_ms.clear()
                    for r in range(rounds):
                        for name in sides[r % len(sides):] + sides[:r % len(sides)]:
                            if name == "server":
                                request, batch, roles = clients.request, clients.batch, server_roles
                            else:
                                place_engine_core(psutil.Process(), RAW_PLACEMENTS.get(name, "anywhere"))
                                request = raw.request_encoding if name == RAW_ENCODING else raw.request
                                batch, roles = (lambda: tuple(raw.batch)), raw_roles
                            await asyncio.sleep(SETTLE_S)
                            before, cpu_before = batch(), _side_cpu(name, roles, bench_only, clients, raw)
                            window = await _closed_loop(request, c, seconds)
                            after, cpu_after = batch(), _side_cpu(name, roles, bench_only, clients, raw)
                            window.batch = (after[0] - before[0], after[1] - before[1])
                            window.cpu = {role: cpu_after[role] - cpu_before[role] for role in cpu_after}
                            windows[name].append(window)
                for name in sides:
                    out[name][c] = (Cell.pool(windows[name], clients.engine_ms, clients.encoder_ms) if name == "server"
                                    else Cell.pool(windows[name]))
                out["raw"][c] = max((out[name][c] for name in RAW_PLACEMENTS), key=lambda cell: cell.requests_per_s)
                print(f"  x{c}: " + "\n       ".join(f"{name}: {out[name][c]}" for name in sides),
                      file=sys.stderr, flush=True)
        finally:
            await raw.close()  # gives this process its cores back
    if not one_at_a_time:
        return out
    # transformers one request at a time has no engine to share the machine with: alone.
    with PolicyServerProcess(checkpoint, "--log-level", "warning", "--engine", "hf") as hf:
        for c in levels:
            async with ServerClients(hf, c) as clients:
                await clients.request(0)
                out["hf"][c] = Cell.pool([await _closed_loop(clients.request, c, seconds)])
    return out


def make_checkpoints(root: Path, sizes: list[str]) -> dict[str, Path]:
    out = {}
    for size in sizes:
        out[size] = root / f"policy-{size}"
        if (out[size] / "policy.json").exists():
            continue
        if size == "vision":
            trainer_main(["init-policy", "--out", str(out[size]), *VISION_POLICY, "--force"])
        else:
            trainer_main(["init-policy", "--out", str(out[size]), "--state-dim", str(STATE_DIM), "--action-dim",
                          str(ACTION_DIM), "--tasks", TASKS, "--chunk-size", str(CHUNK), "--preset", size,
                          "--force"])
    return out


SWEEP = {
    "defaults (eager, auto bind, 1 GiB KV)": {},
    "threads: nobind": {"omp_threads_bind": "nobind"},
    "KV cache 2 GiB": {"kv_cache_gib": 2.0},  # vLLM takes whole GiB (VLLM_CPU_KVCACHE_SPACE is an int)
    "KV cache 4 GiB": {"kv_cache_gib": 4.0},
    "max batched tokens 512": {"max_num_batched_tokens": 512},
    "torch.compile": {"enforce_eager": False},
}


async def sweep(checkpoint: Path, size: str, seconds: float) -> None:
    print(f"\n# engine settings, raw engine, {size} policy, 32 in flight, {seconds:g} s, each a fresh process")
    print("| setting | req/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|")
    for name, change in SWEEP.items():
        # Each variant needs a fresh process: vLLM reads its CPU settings once at start.
        code = (f"import asyncio, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"from policy_server import *; "
                f"r = asyncio.run(bench_raw(Path({str(checkpoint)!r}), {seconds}, "
                f"replace(EngineSettings(), **{change!r}), (32,)))[32]; "
                f"print(r.requests_per_s, r.p50_ms, r.p99_ms)")
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
        try:
            rps, p50, p99 = map(float, out.stdout.strip().splitlines()[-1].split())
            print(f"| {name} | {rps:.1f} | {p50:.1f} | {p99:.1f} |", flush=True)
        except (ValueError, IndexError):
            print(f"| {name} | failed: {out.stderr.strip().splitlines()[-1][:80] if out.stderr else '?'} | | |")


def _ratio(a: float, b: float) -> str:
    if b != b:  # not measured (--no-one-at-a-time)
        return "—"
    return f"{a / b:.2f}×" if b > 0 else "∞ (none finished)"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per window")
    parser.add_argument("--rounds", type=int, default=3, help="raw/server window pairs per cell, taken in turns")
    parser.add_argument("--sizes", default="1m,25m",
                        help="policies, comma-separated: 1m, 25m (state policies), vision (configs/vla-reach-pixels "
                             "shape); default 1m,25m")
    parser.add_argument("--no-one-at-a-time", dest="one_at_a_time", action="store_false",
                        help="skip the one-at-a-time (hf engine) server")
    parser.add_argument("--clients", default=",".join(map(str, CONCURRENCY)),
                        help="comma-separated concurrency levels (default 1,8,32,64)")
    parser.add_argument("--sweep", action="store_true", help="also measure engine settings")
    parser.add_argument("--executor", choices=["uni", "mp"], default=None,
                        help="vLLM executor for both the raw engine and the server (default: the server's)")
    parser.add_argument("--server-engine-core", choices=["vllm", "compute"], default="vllm",
                        help="the server's --engine-core (default: its default, vllm)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "evalforge-bench-policy")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    levels = tuple(int(c) for c in args.clients.split(","))
    checkpoints = make_checkpoints(args.workdir, sizes)

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# policy server — {platform.machine()}, {os.cpu_count()} cores, {args.rounds} × {args.seconds:g} s "
          f"per side per cell, taken in turns; executor {args.executor or 'default'}; "
          f"server --engine-core {args.server_engine_core}; started {started}, load average "
          + " / ".join(f"{x:.1f}" for x in os.getloadavg()))
    print("| policy | clients | raw req/s | raw p50/p99 ms | server req/s | server actions/s | server p50/p99 ms "
          "| server engine p50 ms | server / raw | one-at-a-time req/s | one-at-a-time p50/p99 ms | server / one-at-a-time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    placements: list[tuple[str, dict[str, dict[int, Cell]]]] = []
    details: list[tuple[str, dict[str, dict[int, Cell]]]] = []
    settings = replace(EngineSettings(), engine_core_on_compute_cores=args.server_engine_core == "compute")
    if args.executor is not None:
        settings = replace(settings, executor=args.executor)
    for size, checkpoint in checkpoints.items():
        cells = await compare(checkpoint, settings, levels, args.seconds, args.rounds, args.one_at_a_time)
        raw, server = cells["raw"], cells["server"]
        hf = cells["hf"] if args.one_at_a_time else {c: Cell(float("nan"), float("nan"), float("nan")) for c in levels}
        details.append((size, cells))
        for c in levels:
            r, s, h = raw[c], server[c], hf[c]
            print(f"| {size} | {c} | {r.requests_per_s:.1f} | {r.p50_ms:.1f} / {r.p99_ms:.1f} | "
                  f"{s.requests_per_s:.1f} | {s.actions_per_s:.0f} | {s.p50_ms:.1f} / {s.p99_ms:.1f} | "
                  f"{s.engine_p50_ms:.1f} | {s.requests_per_s / r.requests_per_s:.0%} | {h.requests_per_s:.1f} | "
                  f"{h.p50_ms:.1f} / {h.p99_ms:.1f} | {_ratio(s.requests_per_s, h.requests_per_s)} |", flush=True)
        raw_sides = [*RAW_PLACEMENTS, *([RAW_ENCODING] if cells[RAW_ENCODING] else [])]
        placements.append((size, {name: cells[name] for name in raw_sides}))
        worst = min(server[c].requests_per_s / raw[c].requests_per_s for c in levels)
        if cells[RAW_ENCODING]:
            encoding = cells[RAW_ENCODING]
            worst_encoding = min(server[c].requests_per_s / encoding[c].requests_per_s for c in levels)
            verdicts.append((f"{size}: server / raw + encoder, every concurrency (the serving layer's own cost; "
                             "not the target)", f"worst {worst_encoding:.0%}", None))
        same = cells["raw, engine core on compute cores" if settings.engine_core_on_compute_cores
                     else "raw, engine core anywhere"]
        worst_same = min(server[c].requests_per_s / same[c].requests_per_s for c in levels)
        verdicts.append((f"{size}: server ≥ 90% of raw with the same engine-core placement, every concurrency",
                         f"worst {worst_same:.0%}", worst_same >= 0.9))
        verdicts.append((f"{size}: server ≥ 90% of raw at every concurrency", f"worst {worst:.0%}", worst >= 0.9))
        if 1 in levels:
            gap = server[1].p50_ms - raw[1].p50_ms
            verdicts.append((f"{size}: 1-client p50 within 2 ms of raw", f"{gap:+.2f} ms", gap <= 2.0))
            if args.one_at_a_time:
                verdicts.append((f"{size}: 1-client p50 vs one-at-a-time",
                                 f"{server[1].p50_ms:.1f} vs {hf[1].p50_ms:.1f} ms", None))
        if size == "25m" and 32 in levels and args.one_at_a_time:
            ratio = server[32].requests_per_s / max(hf[32].requests_per_s, 1e-9)
            verdicts.append(("25m: server ≥ 1.5× one-at-a-time at 32 clients", _ratio(server[32].requests_per_s,
                                                                                     hf[32].requests_per_s),
                             ratio >= 1.5))
    print("\n# raw engine by placement of vLLM's engine-core process, req/s (the better one is *raw* above); "
          "a vision policy's raw engine also with its encoder in the benchmark process (not a ceiling)")
    print("| policy | raw engine | " + " | ".join(f"{c} in flight" for c in levels) + " |")
    print("|---|---|" + "---:|" * len(levels))
    for size, by_placement in placements:
        for name, cells in by_placement.items():
            print(f"| {size} | {name} | " + " | ".join(f"{cells[c].requests_per_s:.1f}" for c in levels) + " |")
    print("\n# engine batch (mean running requests per engine step) and the server's encoder wait, per side")
    print("| policy | clients | " + " | ".join(f"{name} batch" for name in RAW_PLACEMENTS)
          + " | server batch | server encoder p50 ms | server engine p50 ms |")
    print("|---|---:|" + "---:|" * (len(RAW_PLACEMENTS) + 3))
    for size, cells in details:
        for c in levels:
            def fmt(x: float | None) -> str:
                return "—" if x is None else f"{x:.1f}"
            print(f"| {size} | {c} | " + " | ".join(fmt(cells[name][c].batch_mean) for name in RAW_PLACEMENTS)
                  + f" | {fmt(cells['server'][c].batch_mean)} | {fmt(cells['server'][c].encoder_p50_ms)} "
                  f"| {fmt(cells['server'][c].engine_p50_ms)} |")
    print("\n# CPU ms per finished request, by process (user + system; the idle side's processes stop polling "
          "between windows)")
    print("| policy | clients | side | " + " | ".join(CPU_ROLES) + " | total |")
    print("|---|---:|---|" + "---:|" * (len(CPU_ROLES) + 1))
    for size, cells in details:
        for c in levels:
            for name in (*RAW_PLACEMENTS, RAW_ENCODING, "server"):
                if c not in cells[name]:
                    continue
                cpu = cells[name][c].cpu_ms
                total = sum(v for role, v in cpu.items() if role != "of which encoder")
                print(f"| {size} | {c} | {name} | " + " | ".join(f"{cpu[r]:.2f}" if r in cpu else "—" for r in CPU_ROLES)
                      + f" | {total:.2f} |")
    print(f"\nfinished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          + " / ".join(f"{x:.1f}" for x in os.getloadavg()))
    print("\n| target | measured | met |")
    print("|---|---:|:-:|")
    for name, value, met in verdicts:
        print(f"| {name} | {value} | {'—' if met is None else 'yes' if met else 'NO'} |")
    if args.sweep:
        for size, checkpoint in checkpoints.items():
            await sweep(checkpoint, size, args.seconds)


if __name__ == "__main__":
    asyncio.run(main())
