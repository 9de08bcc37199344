"""SVG plots for the HTML pages, drawn by hand on the server: no matplotlib, no JavaScript.

Five kinds, each a function that returns inline ``<svg>`` markup (``Markup``, safe to
put in a Jinja template as is; every label is escaped here):

- ``interval_bar``: one success rate as a bar with its 95% interval as whiskers, on a
  fixed 0–100% scale, small enough for a table cell (the leaderboard rows; drawn by
  the pages' stylesheet, see its docstring for why it is not SVG);
- ``interval_chart``: labelled horizontal bars with whiskers, one per row (per-task
  success on the evaluation page);
- ``histogram``: counts of values in equal-width bins with "nice" edges, with
  optional vertical markers (policy latency with its p50/p95);
- ``line_chart``: one line per series over time, with points and a shaded interval
  band (a policy's success rate per suite);
- ``difference_chart``: signed differences with their 95% intervals around a zero line
  (per-task candidate − baseline on the comparison page).

SVG elements carry classes the tests and the stylesheet use: ``bar``, ``whisker``,
``hist-bar``, ``series``, ``point``, ``band``, ``marker``. Every chart has
``role="img"`` and an ``aria-label``; hovering a bar or a point shows its figures
(``<title>``). Hand-written SVG costs microseconds per element, so a 1,000-row
leaderboard renders in milliseconds — matplotlib would take that per plot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape

from markupsafe import Markup

# Okabe–Ito: distinguishable with the common colour-vision deficiencies.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
BAR = "#0072B2"
WHISKER = "#1f2933"
GRID = "#d9dee3"
TEXT = "#3e4c59"
MIN_BINS_SHOWN = 5
FONT = 'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif"'


def _n(value: float) -> str:
    """A coordinate with at most one decimal (smaller markup, no visible difference)."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _svg(width: float, height: float, label: str, body: list[str], css_class: str) -> Markup:
    return Markup(f'<svg class="{css_class}" xmlns="http://www.w3.org/2000/svg" width="{_n(width)}" '
                  f'height="{_n(height)}" viewBox="0 0 {_n(width)} {_n(height)}" role="img" '
                  f'aria-label="{escape(label)}" {FONT}>' + "".join(body) + "</svg>")


def nice_step(span: float, count: int) -> float:
    """A step of 1, 2 or 5 × 10^k that cuts ``span`` into about ``count`` parts."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


def _tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


# ---------------------------------------------------------------------------- interval bars


def interval_bar(rate: float | None, low: float | None, high: float | None) -> Markup:
    """A success rate on a 0–100% track, small enough for a table cell: a bar to ``rate`` and whiskers
    from ``low`` to ``high``.

    The one figure here that is not SVG: a ``<span>`` whose three numbers (percent, as CSS
    custom properties) the stylesheet draws as layered background gradients
    (``.interval-bar`` in ``base.html``). It repeats 1,000 times on the leaderboard, and
    Chromium took ~200 ms more to load that page with an inline ``<svg>`` per row (each is
    its own layout root) than with none; painted backgrounds cost next to nothing. The
    figures are in the text beside it, so it is hidden from screen readers.
    """
    if rate is None:
        return Markup("")
    whisker = f";--l:{_n(100 * low)};--h:{_n(100 * high)}" if low is not None and high is not None else ""
    return Markup(f'<span class="interval-bar{"" if whisker else " no-interval"}" '
                  f'style="--r:{_n(100 * rate)}{whisker}" aria-hidden="true"></span>')


@dataclass(frozen=True, slots=True)
class IntervalRow:
    """One bar of an ``interval_chart``: a label, a rate, its interval and its sample size."""

    label: str
    rate: float | None
    low: float | None
    high: float | None
    n: int


def interval_chart(rows: Sequence[IntervalRow], *, width: int = 1000, row_height: int = 22,
                   label_width: int = 220, value_width: int = 200, title: str = "") -> Markup:
    """Horizontal bars with 95% whiskers on a shared 0–100% axis, one row per ``rows`` entry."""
    top, bottom = 8, 26
    plot_x, plot_w = label_width, width - label_width - value_width
    height = top + bottom + row_height * max(len(rows), 1)
    body = []
    for tick in range(0, 101, 20):
        x = plot_x + plot_w * tick / 100
        body.append(f'<line x1="{_n(x)}" y1="{top}" x2="{_n(x)}" y2="{height - bottom}" stroke="{GRID}"/>'
                    f'<text x="{_n(x)}" y="{height - bottom + 15}" font-size="11" fill="{TEXT}" '
                    f'text-anchor="middle">{tick}%</text>')
    for i, row in enumerate(rows):
        y = top + i * row_height
        mid = y + row_height / 2
        body.append(f'<text class="row-label" x="{label_width - 8}" y="{_n(mid + 4)}" font-size="12" '
                    f'fill="{TEXT}" text-anchor="end">{escape(_shorten(row.label, 30))}</text>')
        if row.rate is None:
            body.append(f'<text x="{plot_x + 4}" y="{_n(mid + 4)}" font-size="11" fill="#9aa5b1">'
                        "no scored episodes yet</text>")
            continue
        figures = (f"{_pct(row.rate)} [{_pct(row.low)}, {_pct(row.high)}] n={row.n}"
                   if row.low is not None and row.high is not None else f"{_pct(row.rate)} n={row.n}")
        body.append(f'<rect class="bar" x="{plot_x}" y="{_n(y + 4)}" width="{_n(plot_w * row.rate)}" '
                    f'height="{row_height - 8}" fill="{BAR}" fill-opacity="0.75">'
                    f"<title>{escape(row.label)}: {escape(figures)}</title></rect>")
        if row.low is not None and row.high is not None:
            x0, x1 = plot_x + plot_w * row.low, plot_x + plot_w * row.high
            body.append(f'<g class="whisker" stroke="{WHISKER}" stroke-width="1.5">'
                        f'<line x1="{_n(x0)}" y1="{_n(mid)}" x2="{_n(x1)}" y2="{_n(mid)}"/>'
                        f'<line x1="{_n(x0)}" y1="{_n(y + 3)}" x2="{_n(x0)}" y2="{_n(y + row_height - 3)}"/>'
                        f'<line x1="{_n(x1)}" y1="{_n(y + 3)}" x2="{_n(x1)}" y2="{_n(y + row_height - 3)}"/>'
                        "</g>")
        body.append(f'<text class="row-value" x="{plot_x + plot_w + 8}" y="{_n(mid + 4)}" font-size="11" '
                    f'fill="{TEXT}">{escape(figures)}</text>')
    return _svg(width, height, title or "success rate per row with 95% intervals", body, "chart interval-chart")


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------- histogram


def histogram_bins(values: Sequence[float], target_bins: int | None = None) -> tuple[list[float], list[int]]:
    """Equal-width bins with round edges covering ``values``: (edges, counts), len(edges) = len(counts) + 1."""
    if not values:
        return [], []
    lo, hi = min(values), max(values)
    target = target_bins or min(30, max(6, round(math.sqrt(len(values)))))
    if hi == lo:
        width = nice_step(abs(lo) or 1.0, 10)
        start = math.floor(lo / width) * width
        return [start, start + width], [len(values)]
    width = nice_step(hi - lo, target)
    start = math.floor(lo / width) * width
    count = max(1, math.ceil((hi - start) / width + 1e-9))
    if start + count * width <= hi:  # the maximum sits on the last edge: bins are [a, b)
        count += 1
    counts = [0] * count
    for value in values:
        counts[min(count - 1, int((value - start) // width))] += 1
    return [start + i * width for i in range(count + 1)], counts


def histogram(values: Sequence[float], *, unit: str = "ms", count_label: str = "count",
              markers: Mapping[str, float | None] | None = None,
              width: int = 1000, height: int = 240, title: str = "") -> Markup:
    """Counts of ``values`` in round-edged bins, with labelled vertical ``markers`` (e.g. p50, p95)."""
    left, right, top, bottom = 56, 16, 36, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    edges, counts = histogram_bins(values)
    label = title or f"histogram of {len(values)} values ({unit})"
    if not counts:
        return _svg(width, 40, label, ['<text x="8" y="24" font-size="12" fill="#9aa5b1">no values yet</text>'],
                    "chart histogram")
    while len(counts) < MIN_BINS_SHOWN:  # a narrow spread: empty bins on both sides keep bars bar-shaped
        step = edges[1] - edges[0]
        edges, counts = [edges[0] - step, *edges, edges[-1] + step], [0, *counts, 0]
    lo, hi = edges[0], edges[-1]
    peak = max(counts)
    y_step = nice_step(peak, 4) if peak > 4 else 1
    y_max = math.ceil(peak / y_step) * y_step

    def x_of(value: float) -> float:
        return left + plot_w * (value - lo) / (hi - lo)

    def y_of(count: float) -> float:
        return top + plot_h * (1 - count / y_max)

    body = []
    tick = 0.0
    while tick <= y_max + 1e-9:
        y = y_of(tick)
        body.append(f'<line x1="{left}" y1="{_n(y)}" x2="{width - right}" y2="{_n(y)}" stroke="{GRID}"/>'
                    f'<text x="{left - 6}" y="{_n(y + 4)}" font-size="11" fill="{TEXT}" text-anchor="end">'
                    f"{int(tick)}</text>")
        tick += y_step
    for i, count in enumerate(counts):
        if not count:
            continue
        x0, x1 = x_of(edges[i]), x_of(edges[i + 1])
        step = edges[1] - edges[0]
        tip = f"{_tick_label(edges[i], step)}–{_tick_label(edges[i + 1], step)} {unit}: {count}"
        body.append(f'<rect class="hist-bar" x="{_n(x0 + 0.5)}" y="{_n(y_of(count))}" '
                    f'width="{_n(max(x1 - x0 - 1, 0.5))}" height="{_n(plot_h * count / y_max)}" fill="{BAR}" '
                    f'fill-opacity="0.8"><title>{escape(tip)}</title></rect>')
    x_step = nice_step(hi - lo, 6)
    tick = math.ceil(lo / x_step) * x_step
    while tick <= hi + 1e-9:
        x = x_of(tick)
        body.append(f'<line x1="{_n(x)}" y1="{top + plot_h}" x2="{_n(x)}" y2="{top + plot_h + 4}" '
                    f'stroke="{TEXT}"/><text x="{_n(x)}" y="{top + plot_h + 16}" font-size="11" fill="{TEXT}" '
                    f'text-anchor="middle">{_tick_label(tick, x_step)}</text>')
        tick += x_step
    body.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" stroke="{TEXT}"/>'
                f'<text x="{left + plot_w / 2}" y="{height - 6}" font-size="12" fill="{TEXT}" '
                f'text-anchor="middle">{escape(unit)}</text>'
                f'<text x="14" y="{_n(top + plot_h / 2)}" font-size="12" fill="{TEXT}" text-anchor="middle" '
                f'transform="rotate(-90 14 {_n(top + plot_h / 2)})">{escape(count_label)}</text>')
    for i, (name, value) in enumerate((markers or {}).items()):
        if value is None:
            continue
        x = x_of(min(max(value, lo), hi))
        colour = PALETTE[5] if i else PALETTE[2]
        anchor = "end" if x > left + plot_w * 0.85 else "start"
        dx = -4 if anchor == "end" else 4
        label_y = 12 + 13 * (i % 2)  # above the bars, alternating rows so neighbours do not collide
        body.append(f'<g class="marker"><line x1="{_n(x)}" y1="{label_y - 8}" x2="{_n(x)}" y2="{top + plot_h}" '
                    f'stroke="{colour}" stroke-width="2" stroke-dasharray="5 3"/>'
                    f'<text x="{_n(x + dx)}" y="{label_y}" font-size="11" fill="{colour}" '
                    f'text-anchor="{anchor}">{escape(name)} {value:.1f} {escape(unit)}</text></g>')
    return _svg(width, height, label, body, "chart histogram")


# ---------------------------------------------------------------------------- line chart


@dataclass(frozen=True, slots=True)
class Point:
    """One observation of a series: when, the value, and optionally its interval and a link."""

    when: datetime
    value: float
    low: float | None = None
    high: float | None = None
    href: str | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    points: Sequence[Point]


_TIME_STEPS_S = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400, 7 * 86400,
                 14 * 86400, 30 * 86400, 91 * 86400, 365 * 86400)


def time_ticks(t0: float, t1: float, most: int = 6) -> tuple[list[float], str]:
    """Round tick times (epoch seconds) within [t0, t1] — whole minutes, hours or days (UTC) — and the
    ``strftime`` format their labels need."""
    step = next((s for s in _TIME_STEPS_S if (t1 - t0) / s <= most), _TIME_STEPS_S[-1])
    first = math.ceil(t0 / step) * step
    ticks = [first + i * step for i in range(int((t1 - first) // step) + 1)]
    return ticks, "%m-%d %H:%M" if step < 86400 else "%Y-%m-%d"


def line_chart(series: Sequence[Series], *, width: int = 1000, height: int = 300, title: str = "") -> Markup:
    """Success rate (0–100%) over time: one line per series, points linking to their evaluation,
    a shaded 95% band where points carry intervals, and a legend."""
    left, right, top, bottom = 46, 40, 14, 58
    shown = [s for s in series if s.points]
    label = title or "success rate over time"
    if not shown:
        return _svg(width, 40, label, ['<text x="8" y="24" font-size="12" fill="#9aa5b1">'
                                       "no finished evaluations yet</text>"], "chart line-chart")
    legend_rows = math.ceil(len(shown) / 3)
    height += 18 * (legend_rows - 1)
    plot_w, plot_h = width - left - right, height - top - bottom - 18 * (legend_rows - 1)
    times = [p.when.timestamp() for s in shown for p in s.points]
    t0, t1 = min(times), max(times)
    if t1 - t0 < 1:  # one moment: centre it
        t0, t1 = t0 - 3600, t1 + 3600

    def x_of(moment: datetime) -> float:
        return left + plot_w * (moment.timestamp() - t0) / (t1 - t0)

    def y_of(value: float) -> float:
        return top + plot_h * (1 - value)

    body = []
    for tick in range(0, 101, 20):
        y = y_of(tick / 100)
        body.append(f'<line x1="{left}" y1="{_n(y)}" x2="{width - right}" y2="{_n(y)}" stroke="{GRID}"/>'
                    f'<text x="{left - 6}" y="{_n(y + 4)}" font-size="11" fill="{TEXT}" text-anchor="end">'
                    f"{tick}%</text>")
    ticks, label_format = time_ticks(t0, t1)
    zone = shown[0].points[0].when.tzinfo
    for tick_s in ticks:
        x = left + plot_w * (tick_s - t0) / (t1 - t0)
        body.append(f'<line x1="{_n(x)}" y1="{top}" x2="{_n(x)}" y2="{top + plot_h + 4}" stroke="{GRID}"/>'
                    f'<text x="{_n(x)}" y="{top + plot_h + 16}" font-size="11" fill="{TEXT}" text-anchor="middle">'
                    f"{datetime.fromtimestamp(tick_s, tz=zone).strftime(label_format)}</text>")
    body.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" stroke="{TEXT}"/>')
    for index, item in enumerate(shown):
        colour = PALETTE[index % len(PALETTE)]
        points = sorted(item.points, key=lambda p: p.when)
        banded = [(x_of(p.when), p.low, p.high) for p in points if p.low is not None and p.high is not None]
        if len(banded) > 1:
            upper = " L".join(f"{_n(x)},{_n(y_of(high))}" for x, _, high in banded)
            lower = " L".join(f"{_n(x)},{_n(y_of(low))}" for x, low, _ in reversed(banded))
            body.append(f'<path class="band" d="M{upper} L{lower} Z" fill="{colour}" fill-opacity="0.12"/>')
        path = " L".join(f"{_n(x_of(p.when))},{_n(y_of(p.value))}" for p in points)
        body.append(f'<path class="series" data-series="{escape(item.name)}" d="M{path}" fill="none" '
                    f'stroke="{colour}" stroke-width="2"/>')
        for p in points:
            tip = f"{item.name} {p.when:%Y-%m-%d %H:%M}: {_pct(p.value)}"
            if p.low is not None and p.high is not None:
                tip += f" [{_pct(p.low)}, {_pct(p.high)}]"
            if p.note:
                tip += f" — {p.note}"
            dot = (f'<circle class="point" cx="{_n(x_of(p.when))}" cy="{_n(y_of(p.value))}" r="3.5" '
                   f'fill="{colour}"><title>{escape(tip)}</title></circle>')
            body.append(f'<a href="{escape(p.href)}">{dot}</a>' if p.href else dot)
        lx = left + (index % 3) * (plot_w / 3)
        ly = top + plot_h + 46 + 18 * (index // 3)
        body.append(f'<g class="legend"><rect x="{_n(lx)}" y="{_n(ly - 9)}" width="14" height="4" '
                    f'fill="{colour}"/><text x="{_n(lx + 20)}" y="{_n(ly - 4)}" font-size="12" fill="{TEXT}">'
                    f"{escape(_shorten(item.name, 34))}</text></g>")
    return _svg(width, height, label, body, "chart line-chart")


# ---------------------------------------------------------------------------- difference chart


@dataclass(frozen=True, slots=True)
class DifferenceRow:
    """One bar of a ``difference_chart``: a label, a difference (−1…1), its interval and its pairs."""

    label: str
    difference: float | None
    low: float | None
    high: float | None
    n: int


def _signed_pct(value: float) -> str:
    return f"{100 * value:+.1f} pts"


def difference_chart(rows: Sequence[DifferenceRow], *, width: int = 1000, row_height: int = 24,
                     label_width: int = 220, value_width: int = 250, title: str = "") -> Markup:
    """Differences (candidate − baseline, percentage points) as bars from 0 with 95% whiskers, one row each.

    The axis is symmetric around 0 and spans the widest interval (at least ±10 points), so a
    whisker that crosses the 0 line shows at a glance a difference the data cannot tell from none.
    Bars right of 0 (the candidate did better) are blue, left of 0 orange."""
    top, bottom = 8, 26
    plot_x, plot_w = label_width, width - label_width - value_width
    height = top + bottom + row_height * max(len(rows), 1)
    reach = max([0.1] + [abs(v) for r in rows for v in (r.difference, r.low, r.high) if v is not None])
    span = min(1.0, math.ceil(reach / nice_step(reach, 4)) * nice_step(reach, 4))

    def x_of(value: float) -> float:
        return plot_x + plot_w * (value + span) / (2 * span)

    body = []
    step = nice_step(2 * span, 4)
    tick = -span
    while tick <= span + 1e-9:
        x = x_of(tick)
        colour = TEXT if abs(tick) < 1e-9 else GRID
        body.append(f'<line x1="{_n(x)}" y1="{top}" x2="{_n(x)}" y2="{height - bottom}" stroke="{colour}"/>'
                    f'<text x="{_n(x)}" y="{height - bottom + 15}" font-size="11" fill="{TEXT}" '
                    f'text-anchor="middle">{100 * tick:+.0f}</text>')
        tick += step
    for i, row in enumerate(rows):
        y = top + i * row_height
        mid = y + row_height / 2
        body.append(f'<text class="row-label" x="{label_width - 8}" y="{_n(mid + 4)}" font-size="12" '
                    f'fill="{TEXT}" text-anchor="end">{escape(_shorten(row.label, 30))}</text>')
        if row.difference is None:
            body.append(f'<text x="{plot_x + 4}" y="{_n(mid + 4)}" font-size="11" fill="#9aa5b1">'
                        "no pairs yet</text>")
            continue
        figures = _signed_pct(row.difference)
        if row.low is not None and row.high is not None:
            figures += f" [{_signed_pct(row.low)}, {_signed_pct(row.high)}]"
        figures += f" n={row.n}"
        x0, x1 = sorted((x_of(0), x_of(row.difference)))
        colour = BAR if row.difference >= 0 else PALETTE[5]
        body.append(f'<rect class="bar" x="{_n(x0)}" y="{_n(y + 5)}" width="{_n(max(x1 - x0, 1))}" '
                    f'height="{row_height - 10}" fill="{colour}" fill-opacity="0.75">'
                    f"<title>{escape(row.label)}: {escape(figures)}</title></rect>")
        if row.low is not None and row.high is not None:
            w0, w1 = x_of(row.low), x_of(row.high)
            body.append(f'<g class="whisker" stroke="{WHISKER}" stroke-width="1.5">'
                        f'<line x1="{_n(w0)}" y1="{_n(mid)}" x2="{_n(w1)}" y2="{_n(mid)}"/>'
                        f'<line x1="{_n(w0)}" y1="{_n(y + 3)}" x2="{_n(w0)}" y2="{_n(y + row_height - 3)}"/>'
                        f'<line x1="{_n(w1)}" y1="{_n(y + 3)}" x2="{_n(w1)}" y2="{_n(y + row_height - 3)}"/>'
                        "</g>")
        body.append(f'<text class="row-value" x="{plot_x + plot_w + 8}" y="{_n(mid + 4)}" font-size="11" '
                    f'fill="{TEXT}">{escape(figures)}</text>')
    return _svg(width, height, title or "difference per row with 95% intervals", body, "chart difference-chart")
