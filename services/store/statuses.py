"""The states of evaluations and episodes and why an episode failed: the one definition of each.

The store's tables (``models``), the API's bodies (``services/eval_api/schemas.py``)
and the HTTP client all read these. Plain enums, no SQLAlchemy, so the client stays
light. The tables store the values as short strings under a CHECK constraint built
from these enums (``models``), so adding a state is a plain migration.
"""

from __future__ import annotations

import enum


class EvaluationStatus(enum.StrEnum):
    PENDING = "pending"  # created, no episode claimed yet
    RUNNING = "running"  # at least one episode claimed
    FINISHED = "finished"  # every episode terminal and at least one scored
    CANCELLED = "cancelled"  # cancelled by a user; finalised once running episodes end
    FAILED = "failed"  # every episode terminal, none scored (all harness errors)


# After these nothing about an evaluation changes any more that a watcher waits for.
FINAL_EVALUATION_STATUSES = frozenset({EvaluationStatus.FINISHED, EvaluationStatus.CANCELLED,
                                       EvaluationStatus.FAILED})


class EpisodeStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_EPISODE_STATUSES = (EpisodeStatus.SUCCEEDED, EpisodeStatus.FAILED, EpisodeStatus.CANCELLED)


class FailureReason(enum.StrEnum):
    """Why an episode did not run to its end. ``None`` on a failed episode means it ran
    out of steps without success."""

    POLICY_TIMEOUT = "policy_timeout"  # the policy server did not answer in time
    POLICY_ERROR = "policy_error"  # the policy server answered with an error / malformed actions
    ENV_ERROR = "env_error"  # the simulator raised
    WORKER_LOST = "worker_lost"  # the worker died and the episode ran out of attempts
    CANCELLED = "cancelled"  # the evaluation was cancelled before the episode ran
    # The server at the endpoint serves another checkpoint than the one registered (swapped behind
    # the endpoint): it is never scored as the registered policy.
    CHECKPOINT_MISMATCH = "checkpoint_mismatch"
    # The endpoint's host is outside EVALFORGE_POLICY_HOSTS (or the URL has credentials): not connected to.
    ENDPOINT_REFUSED = "endpoint_refused"
    # No try of the episode reached a policy server (refused, unknown host, nothing answering as a
    # policy server): it says nothing about the policy. A server that connects and then hangs is
    # policy_timeout, the policy's own fault.
    POLICY_UNREACHABLE = "policy_unreachable"


# Failures the policy is not answerable for: left out of success rates (but reported).
HARNESS_FAILURES = (FailureReason.ENV_ERROR, FailureReason.WORKER_LOST, FailureReason.CHECKPOINT_MISMATCH,
                    FailureReason.ENDPOINT_REFUSED, FailureReason.POLICY_UNREACHABLE)


class PolicyProtocol(enum.StrEnum):
    """The wire protocol a registered policy server speaks (``services.protocol.adapters``)."""

    EVALFORGE = "evalforge"  # ours: metadata with the checkpoint's sha256, dims, tasks, cameras
    OPENPI = "openpi"  # openpi's WebsocketPolicyServer: free-form metadata, bare observation dicts
    VLA_EVAL = "vla-eval"  # allenai's vla-eval model servers: hello, episode_start/observation/episode_end


class RecordMode(enum.StrEnum):
    """Which episodes of an evaluation are recorded (states, actions, camera frames) for a LeRobot
    dataset (``services/workers/recording.py``). Not part of the protocol: it changes no outcome."""

    NONE = "none"
    FIRST = "first"  # the first episode of each task (its lowest episode index)
    FAILURES = "failures"  # every episode that ran to its end without success (not harness failures)
    ALL = "all"  # every episode that ran to its end


def inference_label(inference: dict | None) -> str:
    """``whole chunk``, ``horizon 1`` or ``ensemble m=0.01``: how an evaluation's inference settings
    (``services/protocol/ensemble.py`` applies them) are named in the API, the CLI, the pages and
    comparisons. Here because it is stdlib only and both the store and the API's schemas read it."""
    inference = inference or {}
    if inference.get("temporal_ensemble") is not None:
        return f"ensemble m={inference['temporal_ensemble']:g}"
    horizon = inference.get("action_horizon")
    return "whole chunk" if horizon is None else f"horizon {horizon}"
