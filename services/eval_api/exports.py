"""Episode exports: every episode of an evaluation with its provenance, as CSV or JSON Lines, streamed.

``GET /evaluations/{id}/episodes?format=csv|jsonl`` answers with ``encode_episodes``'s
chunks, one per batch of rows that ``queries.iter_episodes`` reads, so an export of a
million episodes holds one batch in memory, never all of them.

Each row (``EXPORT_COLUMNS``, in this order) is an episode's columns as the JSON API
writes them (``EpisodeOut``), then its evaluation's provenance repeated on every row
(``PROVENANCE_COLUMNS``): the evaluation id, the suite and its definition hash, the
policy's name, version, checkpoint sha256, revision and protocol, and the inference
settings' label (``whole chunk``, ``horizon 1``…). A file therefore says on every line
what produced it, and files from several evaluations concatenate.

CSV: a header line, then one line per episode; a null is an empty cell, booleans are
``true``/``false``, ``simulator_versions`` is its JSON object as a string, numbers and
timestamps are written as in the JSON API. JSONL: one JSON object per line, the JSON
API's values unchanged. Both are UTF-8.

Stdlib and pydantic only (the command line reads ``EXPORT_COLUMNS`` to write parquet).
"""

from __future__ import annotations

import csv
import enum
import io
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from services.eval_api.schemas import EpisodeOut
from services.store.statuses import inference_label


class ExportFormat(enum.StrEnum):
    """The formats the API streams episodes in (parquet is written by the client from JSONL)."""

    CSV = "csv"
    JSONL = "jsonl"

    @property
    def media_type(self) -> str:
        return {ExportFormat.CSV: "text/csv; charset=utf-8", ExportFormat.JSONL: "application/x-ndjson"}[self]


EPISODE_COLUMNS: dict[str, str] = {
    "id": "int", "episode_index": "int", "task": "str", "seed": "int", "max_steps": "int", "status": "str",
    "success": "bool", "total_return": "float", "steps": "int", "duration_s": "float",
    "latency_mean_ms": "float", "latency_p95_ms": "float", "failure_reason": "str", "error_message": "str",
    "attempts": "int", "worker_id": "str", "worker_host": "str", "renderer": "str",
    "simulator_versions": "json", "initial_state_index": "int", "started_at": "timestamp",
    "finished_at": "timestamp",
}
"""An episode's exported columns and their kinds (``json``: an object; ``timestamp``: ISO 8601 UTC)."""

PROVENANCE_COLUMNS: dict[str, str] = {
    "evaluation_id": "int", "suite": "str", "definition_hash": "str", "policy_name": "str",
    "policy_version": "str", "policy_checkpoint_sha256": "str", "policy_revision": "str",
    "policy_protocol": "str", "inference": "str",
}
"""The evaluation's provenance, repeated on each row."""

EXPORT_COLUMNS: dict[str, str] = {**EPISODE_COLUMNS, **PROVENANCE_COLUMNS}


def provenance_columns(evaluation: Any) -> dict[str, Any]:
    """``PROVENANCE_COLUMNS`` of an evaluation (a ``models.Evaluation`` with its policy)."""
    policy = evaluation.policy
    return {"evaluation_id": evaluation.id, "suite": evaluation.suite, "definition_hash": evaluation.definition_hash,
            "policy_name": policy.name, "policy_version": policy.version,
            "policy_checkpoint_sha256": policy.checkpoint_sha256, "policy_revision": policy.revision,
            "policy_protocol": policy.protocol, "inference": inference_label(evaluation.inference)}


def export_record(episode: Any, provenance: Mapping[str, Any]) -> dict[str, Any]:
    """One exported row: ``episode`` (a row of ``episodes``) as the JSON API writes it, then ``provenance``."""
    values = EpisodeOut.model_validate(episode).model_dump(mode="json")
    return {**{column: values[column] for column in EPISODE_COLUMNS}, **provenance}


def csv_cell(value: Any) -> str:
    """A JSON value as a CSV cell: null → empty, booleans ``true``/``false``, objects as JSON text."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def filename(evaluation_id: int, export_format: ExportFormat) -> str:
    """The download's name: ``evaluation-12-episodes.csv``."""
    return f"evaluation-{evaluation_id}-episodes.{export_format.value}"


def encode_episodes(batches: Iterable[Sequence[Any]], provenance: Mapping[str, Any],
                    export_format: ExportFormat) -> Iterator[bytes]:
    """The export, one UTF-8 chunk per batch of episode rows (CSV: the header first)."""
    if export_format is ExportFormat.CSV:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(EXPORT_COLUMNS)
        yield buffer.getvalue().encode()
        for batch in batches:
            buffer.seek(0)
            buffer.truncate()
            for episode in batch:
                writer.writerow([csv_cell(value) for value in export_record(episode, provenance).values()])
            yield buffer.getvalue().encode()
        return
    for batch in batches:
        yield "".join(json.dumps(export_record(episode, provenance), separators=(",", ":")) + "\n"
                      for episode in batch).encode()
