"""Small builders for store tests: a policy, an evaluation with its episodes, finished results."""

from __future__ import annotations

from sqlalchemy.orm import Session

from services.store import queries
from services.store.models import Policy

TASKS = ("reach-v3", "push-v3")


def add_policy(session: Session, name: str = "bc", version: str = "v1", tasks: tuple[str, ...] = TASKS) -> Policy:
    return queries.create_policy(session, name=name, version=version, endpoint="ws://127.0.0.1:1/ws",
                                 checkpoint_sha256="ab" * 32, state_dim=39, action_dim=4, chunk_size=4,
                                 tasks=tasks)


def add_evaluation(session: Session, policy: Policy, *, suite: str = "metaworld-mt10",
                   tasks: tuple[str, ...] = TASKS, per_task: int = 2, seed: int = 0, standard: bool = True,
                   tags: tuple[str, ...] = (), idempotency_key: str | None = None,
                   request_sha256: str | None = None, created_by_key_id: int | None = None) -> queries.CreatedEvaluation:
    episodes = [queries.EpisodeSpec(task=task, seed=1_000_000 + seed + i, max_steps=500)
                for task in tasks for i in range(per_task)]
    return queries.create_evaluation(
        session, policy_id=policy.id, suite=suite, tasks=tasks, episodes_per_task=per_task, seed=seed,
        max_steps=None, standard=standard, tags=tags, episodes=episodes, idempotency_key=idempotency_key,
        request_sha256=request_sha256, created_by_key_id=created_by_key_id)


def run_all(session: Session, episode_ids: list[int], successes: set[int] = frozenset(), *,
            steps: int = 100, latency_ms: float = 10.0) -> None:
    """Claim and finish every episode: the ones in ``successes`` succeed, the rest run out of steps."""
    for episode_id in episode_ids:
        assert queries.claim_episode(session, episode_id, "w", 60)
        ok = episode_id in successes
        queries.finish_episode(session, episode_id, success=ok, total_return=1.0, steps=steps if ok else 500,
                               duration_s=1.0, latency_mean_ms=latency_ms, latency_p95_ms=latency_ms * 2)
