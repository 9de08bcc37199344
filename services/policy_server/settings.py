"""Settings of the policy server (`policy-server`), from the environment and its flags.

Every field is a ``POLICY_SERVER_*`` environment variable and a flag of the same name
(``max_num_seqs`` ↔ ``POLICY_SERVER_MAX_NUM_SEQS`` ↔ ``--max-num-seqs``); a flag given on
the command line overrides the variable, which overrides the default below. The command
builds its one instance from both (``services/policy_server/cli.py``), so there is no
import-time instance here as the API and the workers have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.policy_server.engines import EngineSettings
from services.protocol.codec import DEFAULT_LIMITS

_ENGINE = EngineSettings()  # the engine's own defaults, not restated here
LogLevel = Literal["debug", "info", "warning", "error"]


class PolicyServerSettings(BaseSettings):
    """``POLICY_SERVER_*`` variables that configure `policy-server` (its flags override them)."""

    model_config = SettingsConfigDict(env_prefix="POLICY_SERVER_", extra="ignore")

    checkpoint: Path | None = Field(None, description=(
        "Policy checkpoint directory to serve (HF weights + policy.json); required, as --checkpoint or "
        "POLICY_SERVER_CHECKPOINT."))
    host: str = Field("127.0.0.1", description="Address to bind (0.0.0.0: every interface).")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (HTTP and WebSocket).")
    engine: Literal["vllm", "hf", "null"] = Field("vllm", description=(
        "vllm: continuous batching; hf: transformers, one request at a time; null: no model, zero actions at "
        "once (plumbing measurement only)."))
    name: str | None = Field(None, description=(
        "Policy name announced in the handshake; unset: policy.json's name."))
    # the vLLM engine
    dtype: str = Field(_ENGINE.dtype, description="Weights and activations dtype of the vLLM engine.")
    max_num_seqs: int = Field(_ENGINE.max_num_seqs, ge=1, description="Most requests vLLM batches in one engine step.")
    max_num_batched_tokens: int | None = Field(_ENGINE.max_num_batched_tokens, ge=1, description=(
        "Most tokens vLLM schedules in one engine step; unset: vLLM's default."))
    kv_cache_gib: int = Field(_ENGINE.kv_cache_gib, description=(
        "vLLM's KV-cache space on CPU hosts, whole GiB (at least 1: vLLM reads VLLM_CPU_KVCACHE_SPACE as an "
        "integer)."))
    memory_utilization: float = Field(_ENGINE.memory_utilization, gt=0, le=1, description=(
        "Fraction of device (or, on CPU, host) memory vLLM may claim."))
    compile: bool = Field(False, description="Let vLLM torch.compile the model (slower start).")
    omp_threads_bind: str | None = Field(None, description=(
        "CPU cores for vLLM's OpenMP threads, e.g. '0-1' or 'nobind'; unset: vLLM's auto."))
    executor: Literal["uni", "mp"] | None = Field(None, description=(
        "uni: run the model inside the engine-core process (one process fewer); mp: a worker process per "
        "device; unset: vLLM's choice."))
    engine_core: Literal["vllm", "compute"] = Field("vllm", description=(
        "CPU hosts: where vLLM's engine-core (scheduler) process runs. vllm: where vLLM leaves it, "
        "the fastest on a host that serves; its busy-wait takes a core's idle time. compute: on its worker's "
        "cores, so the other cores stay free for simulators or clients on this host (evalforge up and "
        "trainer rollout use it; docs/benchmarks.md)."))
    # the server
    loop: Literal["asyncio", "uvloop"] = Field("asyncio", description=(
        "Event loop (asyncio by default: vLLM's front end kept less of the raw engine's throughput on "
        "uvloop; docs/benchmarks.md)."))
    max_frame_bytes: int = Field(DEFAULT_LIMITS.max_frame_bytes, ge=1024, description="Largest request frame accepted, bytes.")
    drain_timeout_s: float = Field(30.0, ge=0, description=(
        "Seconds to wait for in-flight requests on shutdown before exiting anyway."))
    log_level: LogLevel = Field("info", description="Logging level of the server and uvicorn.")

    @field_validator("kv_cache_gib", mode="before")
    @classmethod
    def _whole_gib(cls, value: object) -> object:
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return value  # pydantic names the type error
        if number < 1 or number != int(number):
            raise ValueError(f"{value!r} is not a whole number of GiB >= 1 (vLLM's VLLM_CPU_KVCACHE_SPACE takes "
                             "an integer); pass e.g. 1 or 4")
        return int(number)
