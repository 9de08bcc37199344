"""The rows of the two long tables — the leaderboard (1,000 policies) and the episodes — as HTML.

Built here with f-strings rather than in the templates because they are the pages'
hot path: a Jinja expression costs an escape and a ``Markup`` object per cell, which
for 1,000 rows × 8 cells was most of the leaderboard's server time. Every value from
the store is escaped (``html.escape``); the result is ``Markup`` for the template.

Sorting (the inline script in ``base.html``) reads a cell's ``data-value`` when it has
one and its text otherwise, so cells whose text already sorts right carry none.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from html import escape

from markupsafe import Markup

from services.eval_api.pages.plots import interval_bar
from services.eval_api.schemas import InferenceSettings
from services.store.models import Episode
from services.store.queries import LeaderboardEntry


def pct(value: float | None) -> str:
    """A rate as a percentage with one decimal; an em dash for none."""
    return "—" if value is None else f"{100 * value:.1f}%"


def when(moment: datetime | None) -> str:
    """A datetime as ``YYYY-MM-DD HH:MM`` (the pages say the zone once: UTC); an em dash for none."""
    return "—" if moment is None else moment.strftime("%Y-%m-%d %H:%M")


def num(value: float | None, digits: int = 1) -> str:
    """A number with ``digits`` decimals and thousands separators; an em dash for none."""
    return "—" if value is None else f"{value:,.{digits}f}"


def ms(value: float | None) -> str:
    """Milliseconds with one decimal and the unit; an em dash for none."""
    return "—" if value is None else f"{value:,.1f} ms"


def _inference_badge(inference: dict | None) -> str:
    """A marker for an entry whose evaluation did not execute whole chunks (its numbers measure that)."""
    if not inference:
        return ""
    label = escape(InferenceSettings.model_validate(inference).label)
    return f' <span class="badge" title="inference settings other than the defaults">{label}</span>'


def _versus_above(entry: LeaderboardEntry) -> str:
    """The difference-from-above cell: a "≈" mark when not significant, the difference and its interval."""
    above = entry.versus_above
    if above is None:
        return "<td></td>"
    mark = ('<span class="badge" title="not significantly different from the entry above">≈</span> '
            if entry.not_different_from_above else "")
    return (f'<td class="versus" data-value="{above.difference}">{mark}{100 * above.difference:+.1f} '
            f'<span class="ci">[{100 * above.ci_low:.1f}, {100 * above.ci_high:.1f}] {above.method}</span></td>')


def leaderboard_rows(entries: Sequence[LeaderboardEntry], ui_root: str) -> Markup:
    """``<tr>`` per entry: rank, policy, pooled success rate, interval bar and bounds, episodes, date,
    difference from the entry above, and the evaluations pooled."""
    rows = []
    for e in entries:
        policy = e.policy
        evaluations = ", ".join(f'<a href="{ui_root}evaluations/{i}">#{i}</a>' for i in e.evaluation_ids)
        rows.append(
            f'<tr><td class="num">{e.rank}</td>'
            f'<td class="policy"><a href="{ui_root}policies/{policy.id}">{escape(policy.name)}</a> '
            f'<span class="ci">{escape(policy.version)}</span>{_inference_badge(e.inference)}</td>'
            f'<td class="num rate" data-value="{e.success_rate}">{pct(e.success_rate)}</td>'
            f'<td class="interval" data-value="{e.ci_low}">{interval_bar(e.success_rate, e.ci_low, e.ci_high)}'
            f'<span class="ci">{pct(e.ci_low)}–{pct(e.ci_high)}</span></td>'
            f'<td class="num">{e.episodes}</td><td>{when(e.finished_at)}</td>{_versus_above(e)}'
            f'<td class="num" data-value="{e.evaluation_ids[-1]}">{evaluations}</td></tr>')
    return Markup("".join(rows))


def episode_rows(episodes: Sequence[Episode], ui_root: str) -> Markup:
    """``<tr>`` per episode: index, task, seed, status, success, steps, return, latency, failure, attempts
    and its replay GIF where one was recorded."""
    rows = []
    for e in episodes:
        success = "—" if e.success is None else "yes" if e.success else "no"
        src = f"{ui_root}episodes/{e.id}/replay.gif"
        replay = (f'<td class="replay"><a href="{src}"><img class="replay" src="{src}" alt="replay of episode '
                  f'{e.episode_index}" loading="lazy"></a></td>' if e.artifact_path else "<td></td>")
        error = f' title="{escape(e.error_message)}"' if e.error_message else ""
        rows.append(
            f'<tr><td class="num">{e.episode_index}</td><td>{escape(e.task)}</td><td class="num">{e.seed}</td>'
            f'<td><span class="badge {e.status}">{e.status}</span></td><td>{success}</td>'
            f'<td class="num">{"—" if e.steps is None else e.steps}</td>'
            f'<td class="num">{num(e.total_return, 2)}</td><td class="num">{num(e.latency_mean_ms)}</td>'
            f'<td{error}>{escape(e.failure_reason or "")}</td><td class="num">{e.attempts}</td>{replay}</tr>')
    return Markup("".join(rows))
