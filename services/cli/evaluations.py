"""Submit evaluations to the evaluation API, follow them, list and cancel them.

An evaluation plays every task of a suite (or --task subsets) for
--episodes-per-task episodes on held-out evaluation seeds; --watch shows its
progress until it is done, then its per-task results with Wilson 95% intervals.
``compare A B`` pairs two evaluations' episodes by task and seed and says whether
the candidate B differs from the baseline A (docs/statistics.md); ``rerun ID``
submits an evaluation's protocol again and, with --watch, compares the two.
``export ID --format csv|jsonl|parquet`` writes every episode with its provenance
(services/eval_api/exports.py names the columns). ``submit --record first|failures|all`` records
episodes; ``dataset ID --out DIR`` writes them as a LeRobot v3 dataset that ``trainer vla`` trains on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.cli.connection import (
    add_connection_options,
    add_json_option,
    add_watch_options,
    client_verb,
    positive_int,
)
from services.store.statuses import EvaluationStatus, RecordMode

if TYPE_CHECKING:
    from services.client import EvalForgeClient
    from services.eval_api.schemas import EvaluationDetail

EXPORT_FORMATS = ("csv", "jsonl", "parquet")
PARQUET_BATCH_ROWS = 10_000  # rows per parquet row group: one batch in memory, never the whole export
# The API joins an evaluation's recordings into a dataset before it sends a byte: wait at least this long.
DATASET_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    submit_parser = actions.add_parser("submit", help="start an evaluation")
    submit_parser.add_argument("--policy", required=True, metavar="ID|NAME|NAME:VERSION",
                               help="a registered policy (`evalforge policy list`)")
    submit_parser.add_argument("--suite", required=True, help="benchmark suite, e.g. metaworld-mt10 (GET /suites)")
    submit_parser.add_argument("--episodes-per-task", required=True, type=positive_int, metavar="N")
    submit_parser.add_argument("--seed", type=int, default=0, help="first evaluation seed (default: 0)")
    submit_parser.add_argument("--task", dest="tasks", action="append", metavar="TASK",
                               help="evaluate only this task (repeatable; default: every task of the suite)")
    submit_parser.add_argument("--max-steps", type=positive_int, metavar="N",
                               help="step limit per episode, at most each task's own (default: the task's)")
    submit_parser.add_argument("--tag", dest="tags", action="append", metavar="TAG", help="a label (repeatable)")
    submit_parser.add_argument("--camera", dest="cameras", action="append", type=camera_option,
                               metavar="NAME[=HxW]", help=(
                                   "render this camera of the suite for the policy (repeatable; default size: "
                                   "the suite's); default: the cameras the policy asks for"))
    inference = submit_parser.add_mutually_exclusive_group()
    inference.add_argument("--action-horizon", type=positive_int, metavar="K", help=(
        "execute the first K actions of each chunk, then ask again (default: the whole chunk)"))
    inference.add_argument("--temporal-ensemble", type=float, metavar="M", help=(
        "ACT's temporal ensembling: a chunk every step, overlapping actions averaged with weights exp(-M·i)"))
    submit_parser.add_argument("--record", choices=[mode.value for mode in RecordMode], default=RecordMode.NONE.value,
                               help=("record episodes as a LeRobot dataset (`evalforge eval dataset`): the first "
                                     "of each task, those that ran out of steps (failures) or all (default: none)"))
    submit_parser.add_argument("--idempotency-key", metavar="KEY",
                               help="retry-safe submission: the same key and request return the same evaluation")
    add_watch_options(submit_parser)
    submit_parser.set_defaults(action_run=client_verb(submit))

    status_parser = actions.add_parser("status", help="an evaluation's status and results")
    status_parser.add_argument("id", type=positive_int, help="evaluation id (`evalforge eval list`)")
    add_watch_options(status_parser)
    status_parser.set_defaults(action_run=client_verb(status))

    list_parser = actions.add_parser("list", help="evaluations, newest first")
    list_parser.add_argument("--policy", metavar="ID|NAME|NAME:VERSION", help="only this policy's")
    list_parser.add_argument("--suite", help="only this suite's")
    list_parser.add_argument("--status", choices=[status.value for status in EvaluationStatus],
                             help="only those in this status")
    list_parser.add_argument("--tag", help="only those with this tag")
    list_parser.add_argument("--limit", type=positive_int, default=20, metavar="N", help="at most N (default: 20)")
    list_parser.set_defaults(action_run=client_verb(list_evaluations))

    cancel_parser = actions.add_parser("cancel", help="cancel an evaluation")
    cancel_parser.add_argument("id", type=positive_int, help="evaluation id")
    cancel_parser.set_defaults(action_run=client_verb(cancel))

    compare_parser = actions.add_parser("compare", help="compare two evaluations episode by episode (paired)")
    compare_parser.add_argument("baseline", type=positive_int, metavar="BASELINE", help="the baseline evaluation's id")
    compare_parser.add_argument("candidate", type=positive_int, metavar="CANDIDATE",
                                help="the candidate evaluation's id (same suite, tasks, seeds and settings)")
    compare_parser.set_defaults(action_run=client_verb(compare))

    export_parser = actions.add_parser("export", help="write every episode, with its provenance, to a file")
    export_parser.add_argument("id", type=positive_int, help="evaluation id")
    export_parser.add_argument("--format", required=True, choices=EXPORT_FORMATS, help=(
        "csv and jsonl as the API streams them; parquet written here from the streamed JSONL (needs pyarrow)"))
    export_parser.add_argument("--out", type=Path, metavar="FILE",
                               help="where to write it (default: evaluation-ID-episodes.FORMAT here)")
    export_parser.set_defaults(action_run=client_verb(export))

    rerun_parser = actions.add_parser("rerun", help=(
        "submit an evaluation's protocol again and compare the two (the reproducibility check)"))
    rerun_parser.add_argument("id", type=positive_int, help="the evaluation to run again")
    add_watch_options(rerun_parser)
    rerun_parser.set_defaults(action_run=client_verb(rerun))

    dataset_parser = actions.add_parser("dataset", help=(
        "write an evaluation's recorded episodes (submit --record) as a LeRobot v3 dataset"))
    dataset_parser.add_argument("id", type=positive_int, help="evaluation id")
    dataset_parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                                help="the dataset's directory (new, or empty); `trainer vla` trains on it")
    dataset_parser.set_defaults(action_run=client_verb(dataset))

    for action_parser in (submit_parser, status_parser, list_parser, cancel_parser, compare_parser, export_parser,
                          rerun_parser, dataset_parser):
        add_connection_options(action_parser)
        add_json_option(action_parser)


def run(args: argparse.Namespace) -> int:
    return args.action_run(args)


def _watch(args: argparse.Namespace, client: EvalForgeClient, evaluation_id: int) -> EvaluationDetail:
    from services.cli.render import watch_with_progress

    return watch_with_progress(client, evaluation_id, poll_s=args.poll_s, timeout_s=args.watch_timeout_s)


def camera_option(value: str) -> tuple[str, tuple[int, int] | None]:
    """``NAME`` or ``NAME=HxW`` (e.g. ``corner=96x96``) → (name, size or None for the suite's default)."""
    name, _, size = value.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"--camera {value!r}: give a camera name, e.g. corner or corner=96x96")
    if not size:
        return name, None
    height, _, width = size.lower().partition("x")
    if not (height.isdigit() and width.isdigit()):
        raise argparse.ArgumentTypeError(f"--camera {value!r}: the size must be HEIGHTxWIDTH in pixels, e.g. "
                                         f"{name}=96x96")
    return name, (int(height), int(width))


def _camera_sizes(client: EvalForgeClient, suite: str,
                  cameras: list[tuple[str, tuple[int, int] | None]]) -> dict[str, tuple[int, int]]:
    """Sizes for ``--camera`` values: a name alone gets the suite's default size (``GET /suites``); a
    name the suite lacks is passed on for the API to refuse with the list of its cameras."""
    defaults: dict[str, tuple[int, int]] = {}
    if any(size is None for _, size in cameras):
        entry = next((s for s in client.suites() if s.name == suite), None)
        defaults = {c.name: (c.height, c.width) for c in entry.cameras} if entry is not None else {}
    return {name: size or defaults.get(name, (96, 96)) for name, size in cameras}


def submit(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.cli.render import print_json, print_results, stdout_console

    policy = client.resolve_policy(args.policy)
    cameras = None if args.cameras is None else _camera_sizes(client, args.suite, args.cameras)
    report = client.submit_evaluation(policy.id, args.suite, args.episodes_per_task, seed=args.seed,
                                      tasks=args.tasks, max_steps=args.max_steps, tags=args.tags,
                                      idempotency_key=args.idempotency_key, cameras=cameras, record=args.record,
                                      inference={key: value for key, value in (
                                          ("action_horizon", args.action_horizon),
                                          ("temporal_ensemble", args.temporal_ensemble)) if value is not None})
    if not args.json:
        print(f"submitted evaluation {report.id}: {report.policy.label} on {report.suite}, "
              f"{report.episodes_total} episodes ({len(report.tasks)} tasks × {report.episodes_per_task})"
              + ("" if args.watch else f"; follow it with `evalforge eval status {report.id} --watch`"))
    if args.watch:
        report = _watch(args, client, report.id)
        if not args.json:
            print_results(report, stdout_console())
    if args.json:
        print_json(report)
    return 0


def status(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.cli.render import print_json, print_results, status_line, stdout_console

    report = _watch(args, client, args.id) if args.watch else client.get_evaluation(args.id)
    if args.json:
        print_json(report)
        return 0
    print(status_line(report))
    if report.episodes_done:
        print_results(report, stdout_console())
    return 0


def list_evaluations(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.cli.render import print_evaluations, print_json, stdout_console

    policy_id = client.resolve_policy(args.policy).id if args.policy is not None else None
    rows = client.list_evaluations(limit=args.limit, policy_id=policy_id, suite=args.suite, status=args.status,
                                   tag=args.tag)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no evaluations match; submit one with `evalforge eval submit --policy P --suite S "
              "--episodes-per-task N`")
        return 0
    print_evaluations(rows, stdout_console())
    return 0


def cancel(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.cli.render import print_json

    report = client.cancel_evaluation(args.id)
    if args.json:
        print_json(report)
        return 0
    print(f"evaluation {report.id} is {report.status}: {report.counts.get('cancelled', 0)} episodes "
          f"cancelled, {report.counts.get('running', 0)} still running finish first")
    return 0


def compare(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.cli.render import print_comparison, print_json, stdout_console

    comparison = client.compare(args.baseline, args.candidate)
    if args.json:
        print_json(comparison)
    else:
        print_comparison(comparison, stdout_console())
    return 0


def rerun(args: argparse.Namespace, client: EvalForgeClient) -> int:
    """Submit the same protocol as evaluation ``args.id`` (policy, suite, tasks, episodes per task,
    seed, step limit, cameras, inference settings, tags, plus ``rerun-of:ID``); with --watch, wait for
    it and print its paired comparison with the original."""
    from services.cli.render import print_comparison, print_json, stdout_console

    original = client.get_evaluation(args.id)
    tags = [*original.tags, *([] if f"rerun-of:{original.id}" in original.tags else [f"rerun-of:{original.id}"])]
    report = client.submit_evaluation(
        original.policy.id, original.suite, original.episodes_per_task, seed=original.seed, tasks=original.tasks,
        max_steps=original.max_steps, tags=tags,
        cameras={name: (size[0], size[1]) for name, size in original.cameras.items()},
        inference=original.inference.model_dump(exclude_none=True))
    if not args.json:
        print(f"submitted evaluation {report.id}: a rerun of evaluation {original.id} ({report.policy.label} on "
              f"{report.suite}, {report.episodes_total} episodes)"
              + ("" if args.watch else f"; compare them once it is done with `evalforge eval compare "
                                       f"{original.id} {report.id}`"))
    if not args.watch:
        if args.json:
            print_json(report)
        return 0
    _watch(args, client, report.id)
    comparison = client.compare(original.id, report.id)
    if args.json:
        print_json(comparison)
    else:
        print_comparison(comparison, stdout_console())
    return 0


def export(args: argparse.Namespace, client: EvalForgeClient) -> int:
    """Write every episode of evaluation ``args.id`` to ``--out``: CSV or JSONL as the API streams it,
    parquet converted here from the streamed JSONL, batch by batch. The file appears only once complete."""
    out: Path = args.out or Path(f"evaluation-{args.id}-episodes.{args.format}")
    if args.format == "parquet":
        try:
            import pyarrow  # noqa: F401 - only to say what is missing before downloading anything
        except ImportError:
            print("evalforge eval export: --format parquet needs pyarrow, which is not installed; install it "
                  "(pip install pyarrow) or export --format csv or jsonl", file=sys.stderr)
            return 2
    partial = out.with_name(out.name + ".partial")
    try:
        with partial.open("wb") as file:
            if args.format == "parquet":
                with ParquetExport(file) as parquet:
                    client.export_episodes(args.id, "jsonl", parquet)
                summary = f"{parquet.rows} episodes"
            else:
                summary = f"{client.export_episodes(args.id, args.format, file):,} bytes"
        os.replace(partial, out)
    except OSError as exc:
        print(f"evalforge eval export: cannot write {out}: {exc.strerror or exc}; pass --out a path in a writable "
              "folder", file=sys.stderr)
        return 1
    finally:
        partial.unlink(missing_ok=True)
    if args.json:
        print(json.dumps({"evaluation_id": args.id, "format": args.format, "out": str(out)}))
    else:
        print(f"wrote evaluation {args.id}'s episodes to {out} ({args.format}, {summary})")
    return 0


def dataset(args: argparse.Namespace, client: EvalForgeClient) -> int:
    """Download evaluation ``args.id``'s recorded episodes as a LeRobot v3 dataset (a tar the API builds)
    and unpack it into ``--out``, which appears only once complete."""
    import shutil
    import tarfile
    import tempfile

    out: Path = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"evalforge eval dataset: {out} exists and is not an empty directory; pass --out a new one",
              file=sys.stderr)
        return 2
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        print(f"evalforge eval dataset: cannot write {out}: {exc.strerror or exc}; pass --out a path in a writable "
              "folder", file=sys.stderr)
        return 1
    try:
        tar_path = scratch / "dataset.tar"
        with tar_path.open("wb") as file:
            size = client.download_dataset(args.id, file, timeout_s=max(args.timeout_s, DATASET_TIMEOUT_S))
        with tarfile.open(tar_path) as tar:
            tar.extractall(scratch / "dataset", filter="data")  # refuses absolute paths, links out, devices
        info = json.loads((scratch / "dataset" / "meta" / "info.json").read_text())
        if out.exists():
            out.rmdir()
        os.replace(scratch / "dataset", out)
    except (OSError, tarfile.TarError, json.JSONDecodeError) as exc:
        print(f"evalforge eval dataset: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {"evaluation_id": args.id, "out": str(out), "episodes": info["total_episodes"],
               "frames": info["total_frames"], "bytes": size}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote evaluation {args.id}'s {info['total_episodes']} recorded episodes ({info['total_frames']} "
              f"frames) to {out} (LeRobot v3); train on it with `trainer vla --config RECIPE --data.path {out}`")
    return 0


class ParquetExport:
    """A binary file object that takes an export's JSON Lines as they arrive and writes them to a parquet
    file, ``PARQUET_BATCH_ROWS`` rows per row group, with the column types of ``exports.EXPORT_COLUMNS``
    (``simulator_versions`` as JSON text, as in CSV; timestamps as UTC timestamps)."""

    def __init__(self, file: Any, batch_rows: int = PARQUET_BATCH_ROWS) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from services.eval_api.exports import EXPORT_COLUMNS, csv_cell

        types = {"int": pa.int64(), "str": pa.string(), "bool": pa.bool_(), "float": pa.float64(),
                 "json": pa.string(), "timestamp": pa.timestamp("us", tz="UTC")}
        self._kinds = EXPORT_COLUMNS
        self._schema = pa.schema([(column, types[kind]) for column, kind in EXPORT_COLUMNS.items()])
        self._writer = pq.ParquetWriter(file, self._schema)
        self._table, self._json_text = pa.Table.from_pylist, csv_cell
        self._batch_rows = batch_rows
        self._pending = b""
        self._rows: list[dict[str, Any]] = []
        self.rows = 0

    def write(self, chunk: bytes) -> int:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        self._rows.extend(self._row(json.loads(line)) for line in lines if line)
        if len(self._rows) >= self._batch_rows:
            self._flush()
        return len(chunk)

    def _row(self, record: dict[str, Any]) -> dict[str, Any]:
        from datetime import datetime

        for column, kind in self._kinds.items():
            value = record.get(column)
            if value is not None and kind == "json":
                record[column] = self._json_text(value)
            elif value is not None and kind == "timestamp":
                record[column] = datetime.fromisoformat(value)
        return record

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_table(self._table(self._rows, schema=self._schema))
            self.rows += len(self._rows)
            self._rows = []

    def __enter__(self) -> ParquetExport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_exc: object) -> None:
        try:
            if exc_type is None and self._pending.strip():
                from services.client import ApiRequestError

                raise ApiRequestError(None, "incomplete_export", f"the export ended mid-line ({len(self._pending)} "
                                      "bytes after the last newline); run `evalforge eval export` again")
            if exc_type is None:
                self._flush()
        finally:
            self._writer.close()
