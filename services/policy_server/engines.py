"""Inference engines behind the policy server: vLLM (default) and transformers.

Both take prompt token ids and return exactly ``max_tokens`` generated ids, each
restricted to the policy's action-token range; greedy unless a temperature is
given.

- ``VllmEngine``: one vLLM v1 ``AsyncLLM`` with ``skip_tokenizer_init``. Every
  request is handed to the engine as soon as it arrives, from whichever
  connection, so concurrent clients share batches (continuous batching).
- ``HfEngine``: the same checkpoint in ``transformers``, one request at a time
  with a KV cache: the reference for parity tests and for debugging, and the
  design openpi's server uses.
- ``NullEngine`` (``--engine null``): no model; answers at once with zero actions, to
  measure the plumbing alone (never a policy).

Vision policies: ``generate`` also takes ``image_rows`` (float32 torch ``[image_len,
hidden]``, the vision encoder's output, ``services/policy_server/vision.py``), the
embeddings of the prompt's image positions (``tokenizer.image_slice``). vLLM gets the
prompt as a mixed token/embedding prompt (``enable_prompt_embeds``; ``is_token_ids``
marks the task and state positions, whose ids it embeds itself); transformers gets
``inputs_embeds`` with the same rows spliced in.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from policy_format import PolicyCheckpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """Knobs of the vLLM engine; defaults suit a small CPU host."""

    dtype: str = "float32"  # float32 keeps vllm and hf bit-for-bit comparable on CPU
    max_num_seqs: int = 256  # requests batched together at most
    max_num_batched_tokens: int | None = None  # vLLM's default when None
    enforce_eager: bool = True  # False enables torch.compile (slow start on small hosts)
    kv_cache_gib: int = 1  # CPU KV-cache space, whole GiB (VLLM_CPU_KVCACHE_SPACE is read as an int)
    memory_utilization: float = 0.5  # fraction of host memory vLLM may claim at start on CPU
    omp_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; None keeps vLLM's "auto"
    # "uni" runs the model in the engine-core process instead of a worker process of
    # its own: one process fewer to schedule on small hosts. None keeps vLLM's choice.
    executor: str | None = None
    # On CPU hosts vLLM binds its compute threads to some cores and reserves the rest:
    # keep this serving process on the reserved ones and vLLM's scheduler process on
    # the compute ones (see move_off_compute_cores).
    keep_off_compute_cores: bool = True
    # policy-server --engine-core compute: the scheduler on the compute cores too, for
    # hosts that also run simulators (see move_off_compute_cores).
    engine_core_on_compute_cores: bool = False
    seed: int = 0


class Engine(ABC):
    """Generates action tokens for prompt token ids."""

    name: str

    def __init__(self, checkpoint: PolicyCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.on_batch: Callable[[int], None] | None = None  # told the batch size of each engine step

    @abstractmethod
    async def start(self) -> None:
        """Load the model; after this, ``generate`` works."""

    @abstractmethod
    async def generate(self, prompt: list[int], *, temperature: float = 0.0, seed: int | None = None,
                       image_rows: object | None = None) -> list[int]:
        """Exactly ``checkpoint.tokenizer.action_len`` ids (one action chunk) from the action range;
        ``image_rows``: a vision policy's image-position embeddings (see the module docstring)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's processes and memory."""


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, checkpoint: PolicyCheckpoint, settings: EngineSettings | None = None) -> None:
        super().__init__(checkpoint)
        self.settings = settings or EngineSettings()
        self._llm = None
        self._greedy = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._cores_before: set[int] | None = None  # this process's cores before start() moved it

    async def start(self) -> None:
        s = self.settings
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{s.kv_cache_gib:g}")
        if s.omp_threads_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = s.omp_threads_bind
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(self.checkpoint.directory),
            skip_tokenizer_init=True,
            dtype=s.dtype,
            max_model_len=self.checkpoint.tokenizer.seq_length,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            enforce_eager=s.enforce_eager,
            gpu_memory_utilization=s.memory_utilization,
            seed=s.seed,
            disable_log_stats=True,  # custom loggers still get the stats (below)
            enable_prefix_caching=False,
            enable_prompt_embeds=self.checkpoint.card.vision is not None,
            distributed_executor_backend=s.executor,
        )
        # Construction blocks for as long as the engine processes take to start;
        # off the event loop, /healthz keeps answering meanwhile.
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args,
                                            stat_loggers=[self._batch_logger_factory()])
        if s.keep_off_compute_cores and hasattr(os, "sched_getaffinity"):
            self._cores_before = os.sched_getaffinity(0)
            move_off_compute_cores(engine_core_too=s.engine_core_on_compute_cores)

    def _batch_logger_factory(self) -> Callable:
        """vLLM's only stats consumer here: the batch size of every engine step.

        It subclasses vLLM's Prometheus logger so that vLLM adds none of its own (a
        custom one replaces it): that logger updates dozens of metrics every engine
        step on the serving core, for a registry this server does not expose. vLLM's
        periodic throughput log line is off too (``disable_log_stats``)."""
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        engine = self

        class BatchSizeLogger(PrometheusStatLogger):
            def __init__(self, vllm_config: object, engine_indexes: list[int] | None = None) -> None:
                pass  # no Prometheus metrics of vLLM's

            def record(self, scheduler_stats: object, iteration_stats: object, mm_cache_stats: object = None,
                       engine_idx: int = 0) -> None:
                running = getattr(scheduler_stats, "num_running_reqs", 0)
                if running and engine.on_batch is not None:
                    engine.on_batch(running)

            def record_sleep_state(self, awake: int = 1, level: int = 0) -> None:
                pass

            def record_admission_rejection(self, reason: str) -> None:
                pass

            def log_engine_initialized(self) -> None:
                pass

            def log(self) -> None:
                pass

        return BatchSizeLogger

    def sampling_params(self, temperature: float, seed: int | None) -> object:
        """Parameters for one request; the greedy ones are built once (vLLM copies them per request)."""
        if temperature == 0.0 and seed is None:
            if self._greedy is None:
                self._greedy = self._build_sampling_params(0.0, None)
            return self._greedy
        return self._build_sampling_params(temperature, seed)

    def _build_sampling_params(self, temperature: float, seed: int | None) -> object:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        n = self.checkpoint.tokenizer.action_len
        # skip_clone: vLLM deep-copies each request's parameters (≈ 0.1 ms with the
        # allowed-token list) unless told they are safe to share. These are: what
        # vLLM adds to its copy (stop ids from the generation config) is the same
        # for every request of this model.
        return SamplingParams(
            max_tokens=n,
            min_tokens=n,
            ignore_eos=True,
            temperature=temperature,
            seed=seed,
            allowed_token_ids=self.checkpoint.tokenizer.allowed_token_ids,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            skip_clone=True,
        )

    @property
    def llm(self) -> object:
        """The underlying vLLM ``AsyncLLM`` (for benchmarks that drive it directly)."""
        assert self._llm is not None, "engine not started"
        return self._llm

    def engine_input(self, prompt: list[int], image_rows: object | None = None) -> object:
        """The prompt as vLLM's rendered token input: a raw ``{"prompt_token_ids": …}``
        prompt would go through vLLM's renderer on a worker thread (two thread
        hand-overs per request); token ids need no rendering.

        With ``image_rows``, a mixed prompt: ``prompt_embeds`` ``[len(prompt), hidden]``
        holding the rows at the image positions (zeros elsewhere, which vLLM ignores),
        ``is_token_ids`` True at the task and state positions, whose ids vLLM embeds."""
        if image_rows is None:
            from vllm.inputs.engine import tokens_input

            return tokens_input(prompt)
        import torch
        from vllm.inputs.engine import embeds_input

        where = self.checkpoint.tokenizer.image_slice
        embeds = torch.zeros(len(prompt), image_rows.shape[-1], dtype=image_rows.dtype)
        embeds[where] = image_rows
        is_token_ids = [True] * len(prompt)
        is_token_ids[where] = [False] * (where.stop - where.start)
        return embeds_input(embeds, prompt_token_ids=prompt, is_token_ids=is_token_ids)

    async def generate(self, prompt: list[int], *, temperature: float = 0.0, seed: int | None = None,
                       image_rows: object | None = None) -> list[int]:
        assert self._llm is not None, "engine not started"
        request_id = f"{self._prefix}-{next(self._ids)}"
        final = None
        async for output in self._llm.generate(self.engine_input(prompt, image_rows),
                                               self.sampling_params(temperature, seed), request_id=request_id):
            final = output
        assert final is not None
        return list(final.outputs[0].token_ids)

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._cores_before is not None:
            # Give the cores back: an engine started later in this process (or a
            # process started from it) would otherwise see only the serving cores.
            import psutil

            pin_threads(psutil.Process(), self._cores_before)
            self._cores_before = None


class HfEngine(Engine):
    name = "hf"

    def __init__(self, checkpoint: PolicyCheckpoint) -> None:
        super().__init__(checkpoint)
        self._model = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self._model = await asyncio.to_thread(self._load)

    def _load(self) -> object:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.checkpoint.directory), dtype=torch.float32)
        return model.eval()

    async def generate(self, prompt: list[int], *, temperature: float = 0.0, seed: int | None = None,
                       image_rows: object | None = None) -> list[int]:
        async with self._lock:  # one request at a time, by design
            if self.on_batch is not None:
                self.on_batch(1)
            return await asyncio.to_thread(self.generate_sync, prompt, temperature, seed, image_rows)

    def prompt_inputs(self, prompt: list[int], image_rows: object | None = None) -> dict[str, object]:
        """The model's keyword inputs for a prompt: ``input_ids``, or ``inputs_embeds`` with the image rows in."""
        import torch

        ids = torch.tensor([prompt])
        if image_rows is None:
            return {"input_ids": ids}
        embeds = self._model.get_input_embeddings()(ids)
        embeds[0, self.checkpoint.tokenizer.image_slice] = image_rows.to(embeds.dtype)
        return {"inputs_embeds": embeds}

    def generate_sync(self, prompt: list[int], temperature: float = 0.0, seed: int | None = None,
                      image_rows: object | None = None) -> list[int]:
        import torch

        assert self._model is not None, "engine not started"
        start, end = self.checkpoint.tokenizer.action.token_range
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tokens: list[int] = []
        with torch.inference_mode():
            out = self._model(**self.prompt_inputs(prompt, image_rows), use_cache=True)
            for _ in range(self.checkpoint.tokenizer.action_len):
                logits = out.logits[0, -1, start:end].float()
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    choice = int(torch.multinomial(probs, 1, generator=generator))
                else:
                    choice = int(torch.argmax(logits))
                tokens.append(start + choice)
                out = self._model(torch.tensor([[start + choice]]), past_key_values=out.past_key_values,
                                  use_cache=True)
        return tokens


class NullEngine(Engine):
    """Answers at once with the action tokens nearest zero, without loading any model: for measuring
    the service's plumbing alone (``bench/control_plane.py``, with the ``null`` suite). Never a policy."""

    name = "null"

    def __init__(self, checkpoint: PolicyCheckpoint) -> None:
        super().__init__(checkpoint)
        tokenizer = checkpoint.tokenizer
        zeros = np.zeros((tokenizer.chunk_size, tokenizer.action_dim), dtype=np.float32)
        self._tokens = tokenizer.action.encode(zeros).reshape(-1).tolist()

    async def start(self) -> None:
        pass

    async def generate(self, prompt: list[int], *, temperature: float = 0.0, seed: int | None = None,
                       image_rows: object | None = None) -> list[int]:
        if self.on_batch is not None:
            self.on_batch(1)
        return list(self._tokens)


def move_off_compute_cores(engine_core_too: bool = False) -> None:
    """Split the cores: vLLM's engine on its compute cores, this serving process on the rest.

    vLLM's CPU backend binds each worker's OpenMP threads to its own cores and
    leaves the others unbound. Two moves, both no-ops on GPU hosts and where the
    workers are not bound (their affinity is every core):

    - this process (event loop: decoding requests, sending replies, vLLM's output
      handler) goes to the cores the workers are not bound to, so it never
      preempts a model step;
    - with ``engine_core_too`` (``policy-server --engine-core compute``), vLLM's
      engine-core process (the scheduler) goes to the workers' cores too. Left where
      vLLM puts it (the default), it spins on ``sched_yield()`` while the worker
      computes, taking the idle time of the other cores: the fastest placement on a
      host that serves, but on a small host that also runs simulators they lose
      that core time; with Linux's session autogroups the yield does not even reach
      processes of other login sessions, and on 2 cores such local clients stalled
      for up to a second. On the workers' cores the two take turns, which costs
      small models up to a quarter of their throughput on 2 cores
      (docs/benchmarks.md, "Policy server"); ``evalforge up`` and ``trainer
      rollout`` choose it, as they run simulators next to the server.
    """
    import psutil
    import torch

    if torch.cuda.is_available() or not hasattr(os, "sched_setaffinity"):
        return
    me = psutil.Process()
    everything = set(me.cpu_affinity())
    compute: set[int] = set()
    engine_cores: list[psutil.Process] = []
    for child in me.children(recursive=True):
        try:
            name = child.name()
            if "Worker" in name or "EngineCore" in name:
                if "EngineCore" in name and engine_core_too:
                    engine_cores.append(child)
                for thread in child.threads():
                    cores = set(os.sched_getaffinity(thread.id))
                    if cores != everything:
                        compute |= cores
        except (psutil.Error, OSError):
            continue
    rest = everything - compute
    if not compute or not rest:
        return
    pin_threads(me, rest)  # threads made later inherit their creator's affinity
    for process in engine_cores:
        pin_threads(process, compute)
    log.info("serving process pinned to cores %s; vLLM's engine core and compute threads to %s",
             sorted(rest), sorted(compute))


def pin_threads(process: object, cores: set[int]) -> None:
    """Affinity is per thread on Linux: set it on every thread of ``process``."""
    import psutil

    try:
        threads = process.threads()
    except psutil.Error:
        return
    for thread in threads:
        try:
            os.sched_setaffinity(thread.id, cores)
        except OSError:
            continue


def build_inference_engine(kind: str, checkpoint: PolicyCheckpoint,
                           settings: EngineSettings | None = None) -> Engine:
    """The inference engine ``kind`` (``vllm`` or ``hf``) for ``checkpoint``, not started yet."""
    if kind == "vllm":
        return VllmEngine(checkpoint, settings)
    if kind == "hf":
        return HfEngine(checkpoint)
    if kind == "null":
        return NullEngine(checkpoint)
    raise ValueError(f"unknown engine {kind!r}; choose vllm, hf or null")
