"""Terminal rendering of the API's answers: results, leaderboard and listing tables, watch progress.

Used by the ``evalforge`` client verbs and by scripts that show what the client
(``services/client.py``) returns, e.g. ``make demo``. On a terminal a table fits the
terminal, as rich draws it; written to a file or a pipe (a log), a table is drawn
at its full width, so that no name or number is cut to the 80 columns rich assumes
there (``print_table``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime

from pydantic import BaseModel
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from services.client import EvalForgeClient
from services.eval_api.schemas import (
    ComparisonOut,
    ComparisonRow,
    EvaluationDetail,
    EvaluationOut,
    Interval,
    LeaderboardEntryOut,
    LeaderboardOut,
    PolicySummary,
    Results,
)
from services.store.provenance import provenance_line
from services.store.statuses import EpisodeStatus

# Wider than any table here; only bounds the measurement of a table's natural width.
_UNBOUNDED_WIDTH = 10_000


def stdout_console() -> Console:
    """The console the verbs print to (no highlighting of numbers and URLs in plain text)."""
    return Console(highlight=False)


class _NaturalWidth:
    """``renderable`` drawn at the width it needs, whatever width the console has."""

    def __init__(self, renderable: Table) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = options.update_width(_UNBOUNDED_WIDTH)
        yield from console.render(self.renderable, options.update_width(
            Measurement.get(console, wide, self.renderable).maximum))


def print_table(console: Console, table: Table) -> None:
    """``table`` on ``console``: fitted to a terminal; at its natural width elsewhere (never cut)."""
    if console.is_terminal:
        console.print(table)
    else:  # rich would fit it into the 80 columns it assumes for a file, eliding names with "…"
        console.print(_NaturalWidth(table), crop=False)


def percent(rate: float | None) -> str:
    return "–" if rate is None else f"{100 * rate:.1f}%"


def interval(ci: Interval | None) -> str:
    """A Wilson interval as ``[low, high]`` in percent (it is not symmetric, so no ±)."""
    return "–" if ci is None else f"[{100 * ci.low:.1f}, {100 * ci.high:.1f}]"


def _number(value: float | None, unit: str = "") -> str:
    return "–" if value is None else f"{value:,.1f}{unit}"


def _failures(reasons: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in reasons.items() if count) or ""


def _when(value: datetime | None) -> str:
    return "–" if value is None else value.strftime("%Y-%m-%d %H:%M")


def progress_stats(report: EvaluationDetail) -> str:
    """``finished · success 3/4 (75.0%) · pending 2 · …``: status, success so far, episodes per status."""
    parts = [report.status]
    if report.overall.scored:
        parts.append(f"success {report.overall.succeeded}/{report.overall.scored} "
                     f"({percent(report.overall.success_rate)})")
    parts += [f"{status} {report.counts[status]}" for status in EpisodeStatus if report.counts.get(status)]
    return " · ".join(parts)


def status_line(report: EvaluationDetail) -> str:
    """One line: status, policy, suite, episodes done and per status."""
    counts = ", ".join(f"{status} {n}" for status, n in report.counts.items() if n)
    return (f"evaluation {report.id}: {report.status} · policy {report.policy.label} (id {report.policy.id}) · "
            f"{report.suite} · {report.episodes_done}/{report.episodes_total} episodes done "
            f"({counts or 'none yet'})")


def watch_with_progress(client: EvalForgeClient, evaluation_id: int, *, console: Console | None = None,
                        poll_s: float = 1.0, timeout_s: float | None = None) -> EvaluationDetail:
    """``client.watch_evaluation`` with its progress shown on ``console`` (default: stderr).

    On a terminal this is a progress bar of episodes done, with the success rate so
    far and the episodes per status; elsewhere (a log, a pipe) one line each time the
    progress changes. Returns the final report; ``WatchTimeout`` as the client's.
    """
    console = console or Console(stderr=True)
    if console.is_terminal:
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            bars: list[TaskID] = []  # the one bar, added with the first report

            def show(report: EvaluationDetail) -> None:
                if not bars:
                    bars.append(progress.add_task(f"evaluation {report.id}", total=report.episodes_total,
                                                  stats=""))
                progress.update(bars[0], completed=report.episodes_done, total=report.episodes_total,
                                stats=progress_stats(report))

            return client.watch_evaluation(evaluation_id, poll_s=poll_s, timeout_s=timeout_s, on_report=show)
    shown: list[str] = []

    def show_line(report: EvaluationDetail) -> None:
        line = (f"evaluation {report.id}: {report.episodes_done}/{report.episodes_total} episodes done · "
                f"{progress_stats(report)}")
        if not shown or shown[-1] != line:
            console.print(line, highlight=False, soft_wrap=True)
            shown.append(line)

    return client.watch_evaluation(evaluation_id, poll_s=poll_s, timeout_s=timeout_s, on_report=show_line)


def print_results(report: EvaluationDetail, console: Console) -> None:
    """Per-task results of an evaluation: episodes, success rate with its 95% interval, mean steps,
    median policy latency and failure reasons, then the overall row, and a line naming its protocol."""
    title = f"evaluation {report.id} · {report.policy.label} · {report.suite} · {report.status}"
    if not report.inference.is_default:
        title += f" · {report.inference.label}"
    table = Table(title=title, title_justify="left")
    table.add_column("task")
    for column in ("episodes", "success", "95% CI", "mean steps", "latency p50"):
        table.add_column(column, justify="right")
    table.add_column("failures")

    def row(name: str, results: Results, style: str | None = None) -> None:
        latency = results.latency_ms.p50 if results.latency_ms is not None else None
        success = percent(results.success_rate)
        if results.scored:
            success += f" ({results.succeeded}/{results.scored})"
        table.add_row(name, str(results.episodes), success, interval(results.ci95), _number(results.mean_steps),
                      _number(latency, " ms"), _failures(results.failure_reasons), style=style)

    for task in report.per_task:
        row(task.task, task)
    table.add_section()
    row("overall", report.overall, style="bold")
    print_table(console, table)
    protocol = report.protocol.model_dump() if report.protocol is not None else None
    console.print(f"provenance: {provenance_line(protocol)}", highlight=False, soft_wrap=True)


def print_leaderboard(board: LeaderboardOut, console: Console) -> None:
    """A suite's leaderboard: rank, policy, pooled success rate with its 95% interval, episodes, the
    evaluations pooled, date, and the difference from the entry above (``≈``: not significant)."""
    scope = " (all evaluations, incl. task subsets)" if board.include_nonstandard else ""
    if not board.entries:
        console.print(f"no finished evaluations of every task on {board.suite} yet{scope}; submit one with "
                      f"`evalforge eval submit --suite {board.suite} …`", highlight=False, soft_wrap=True)
        return
    table = Table(title=f"leaderboard · {board.suite}{scope}", title_justify="left",
                  caption="vs above: difference from the entry above, 95% interval; ≈ not significantly different",
                  caption_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("policy")
    table.add_column("version")
    for column in ("success", "95% CI", "episodes", "evaluations"):
        table.add_column(column, justify="right")
    table.add_column("finished (UTC)")
    table.add_column("vs above")
    marked = any(not entry.inference.is_default for entry in board.entries)
    if marked:  # only boards with non-standard runs (include_nonstandard) have evaluations to mark
        table.add_column("inference")
    for entry in board.entries:
        cells = [str(entry.rank), entry.policy.name, entry.policy.version, percent(entry.success_rate),
                 interval(entry.ci95), str(entry.episodes), ",".join(str(i) for i in entry.evaluation_ids),
                 _when(entry.finished_at), _versus_above(entry)]
        if marked:
            cells.append("" if entry.inference.is_default else entry.inference.label)
        table.add_row(*cells)
    print_table(console, table)


def _versus_above(entry: LeaderboardEntryOut) -> str:
    """``≈ -1.2 [-6.0, 3.1] paired`` (not significant) or ``-12.0 [-18.2, -5.9] unpaired``; empty for the first."""
    above = entry.difference_from_above
    if above is None:
        return ""
    mark = "≈ " if entry.not_different_from_above else ""
    return f"{mark}{100 * above.difference:+.1f} {interval(above.ci95)} {above.method}"


def print_policies(policies: Iterable[PolicySummary], console: Console) -> None:
    table = Table()
    for column in ("id", "name", "version", "protocol", "checkpoint", "tasks", "endpoint", "registered (UTC)"):
        table.add_column(column, justify="right" if column in ("id", "tasks") else "left")
    for p in policies:
        table.add_row(str(p.id), p.name, p.version, p.protocol, (p.checkpoint_sha256 or p.revision or "")[:12],
                      str(p.task_count) if p.task_count else "any", p.endpoint, _when(p.created_at))
    print_table(console, table)


def print_evaluations(evaluations: Iterable[EvaluationOut], console: Console) -> None:
    table = Table()
    for column in ("id", "policy", "suite", "status", "episodes", "success", "created (UTC)", "tags"):
        table.add_column(column, justify="right" if column in ("id", "episodes", "success") else "left")
    for e in evaluations:
        subset = "" if e.standard else (" (subset)" if e.inference.is_default else f" ({e.inference.label})")
        table.add_row(str(e.id), e.policy.label, e.suite + subset, e.status,
                      str(e.episodes_total), percent(e.success_rate), _when(e.created_at), ", ".join(e.tags))
    print_table(console, table)


def _points(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f}"


def _p_value(p: float | None) -> str:
    return "–" if p is None else ("<0.001" if p < 0.001 else f"{p:.3f}")


def print_comparison(comparison: ComparisonOut, console: Console) -> None:
    """A paired comparison: per task and overall, the pairs, both success rates, the difference
    (candidate − baseline, points) with its 95% interval, McNemar's p and b / c; then the verdict and
    what was left out of the pairs."""
    base, cand = comparison.baseline.evaluation, comparison.candidate.evaluation
    title = (f"candidate {cand.id} ({cand.policy.label}) vs baseline {base.id} ({base.policy.label}) · {base.suite}"
             + (" · live" if comparison.live else ""))
    table = Table(title=title, title_justify="left")
    table.add_column("task")
    for column in ("n", "baseline", "candidate", "difference", "95% CI", "McNemar p", "b / c"):
        table.add_column(column, justify="right")

    def row(result: ComparisonRow, style: str | None = None) -> None:
        ci = "–" if result.ci95 is None else f"[{_points(result.ci95.low)}, {_points(result.ci95.high)}]"
        table.add_row(result.task or "overall", str(result.pairs), percent(result.baseline_rate),
                      percent(result.candidate_rate), _points(result.difference), ci, _p_value(result.p_value),
                      f"{result.baseline_only} / {result.candidate_only}", style=style)

    for result in comparison.per_task:
        row(result)
    table.add_section()
    row(comparison.overall, style="bold")
    print_table(console, table)
    console.print("difference: candidate − baseline, points; 95% CI: Newcombe's paired interval; b: pairs only the "
                  "baseline succeeded on, c: only the candidate", highlight=False, soft_wrap=True)
    for name, side in (("baseline", comparison.baseline), ("candidate", comparison.candidate)):
        left_out = [f"{n} {reason}" for reason, n in side.harness_failures.items()]
        left_out += [f"{n} {what}" for what, n in (("cancelled", side.cancelled), ("not finished", side.unfinished))
                     if n]
        if left_out:
            console.print(f"left out on the {name} side: {', '.join(left_out)}", highlight=False, soft_wrap=True)
    if comparison.unpaired_total:
        console.print(f"{comparison.unpaired_total} unpaired episodes (scored on one side only; --json lists them)",
                      highlight=False, soft_wrap=True)
    console.print(f"verdict: {comparison.verdict}", highlight=False, soft_wrap=True)


def print_json(answer: BaseModel | Sequence[BaseModel]) -> None:
    """An answer (or a list of them) as the API's JSON, for scripts (``--json``)."""
    value = ([item.model_dump(mode="json") for item in answer] if isinstance(answer, Sequence)
             else answer.model_dump(mode="json"))
    print(json.dumps(value, indent=2, ensure_ascii=False))
