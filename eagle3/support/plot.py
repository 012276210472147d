"""PNG line and bar charts for training curves and acceptance reports, drawn with matplotlib's Agg renderer.

Each chart is its own ``matplotlib.figure.Figure`` on a ``FigureCanvasAgg``: pyplot is never imported, so no
GUI backend is chosen, no global figure registry fills up, and charts can be drawn from several threads.
Titles and axis labels wrap to the size of the axes, legends sit outside the axes (never on a curve), and the
file is written atomically. Output is byte-for-byte reproducible for the same input and matplotlib version (no
"Software" metadata).
"""

from __future__ import annotations

import io
import math
import numbers
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from eagle3.support.io import atomic_write_bytes

_DPI = 100  # pixels per inch: width/height arguments are pixels, figsize is inches
_TITLE_PT = 12  # title font size, points
_TITLE_MAX_LINES = 3  # a title wrapped onto more lines than this at _TITLE_PT is set at _TEXT_PT instead
_TEXT_PT = 9  # legend, tick and bar-value font size, points
_PAD_PX = 8  # margin kept free between the title and the image edges, pixels
_LEGEND_ROW_PX = 16  # height of one legend entry at _TEXT_PT, pixels (sets the legend's column count)
_LEGEND_MAX_SIDE = 0.25  # the most of the image width a legend right of the axes may take; wider goes below
_MARKER_MAX_POINTS = 30  # series with this many points or fewer get a dot on each point, so sparse val curves show
_LINESTYLES = ("-", "--", ":", "-.")  # cycled after the 10 default colours, so series 11+ stay distinguishable


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.3g}"


def _figure(width: int, height: int) -> Figure:
    for name, px in (("width", width), ("height", height)):
        if not isinstance(px, numbers.Integral) or isinstance(px, bool) or px < 50:
            raise ValueError(f"chart {name} must be a whole number of pixels >= 50, got {px!r}")
    fig = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself as fig.canvas
    return fig


def _wrap(text, whole: str, room_px: float, vertical: bool = False) -> None:
    """Set ``whole`` on a text artist, wrapped onto as many lines as it takes for its long side to fit ``room_px``."""
    renderer = text.figure.canvas.get_renderer()
    text.set_text(whole)
    chars = len(whole)
    while chars > 1:
        box = text.get_window_extent(renderer)
        used = box.height if vertical else box.width
        if used <= room_px:
            return
        chars = max(1, min(chars - 1, int(chars * room_px / used)))
        text.set_text(textwrap.fill(whole, width=chars))


def _fit_text(fig: Figure, ax, title: str) -> None:
    """Set the axes title and wrap it, and the axis labels, to the axes size (the layout makes room for them).

    The title sits over the axes rather than the whole figure, so it never runs into a legend outside the axes.
    The first room is the axes laid out without a title (a too-wide title would widen the margins and shrink the
    axes); wrapping then shrinks the axes a little, hence a few rounds until the wrapped texts stop changing.
    """
    title_text = ax.set_title("", fontsize=_TITLE_PT)
    xlabel, ylabel = ax.get_xlabel(), ax.get_ylabel()
    texts = (title_text, ax.xaxis.label, ax.yaxis.label)
    renderer = fig.canvas.get_renderer()
    for _ in range(4):
        fig.draw_without_rendering()  # runs the constrained layout
        box = ax.get_window_extent(renderer)
        before = [t.get_text() for t in texts]
        title_text.set_fontsize(_TITLE_PT)
        _wrap(title_text, title, box.width - 2 * _PAD_PX)
        if title_text.get_text().count("\n") >= _TITLE_MAX_LINES:  # small chart: spend less height on the title
            title_text.set_fontsize(_TEXT_PT)
            _wrap(title_text, title, box.width - 2 * _PAD_PX)
        _wrap(ax.xaxis.label, xlabel, box.width)
        _wrap(ax.yaxis.label, ylabel, box.height, vertical=True)
        if [t.get_text() for t in texts] == before:
            return


def _legend(fig: Figure, ax) -> None:
    """A figure legend outside the axes, so it can never hide a curve: on the right, or below when the right
    would take more than _LEGEND_MAX_SIDE of the width (many or long names on a narrow chart)."""
    handles, labels = ax.get_legend_handles_labels()
    rows = max(1, int(0.8 * fig.bbox.height / _LEGEND_ROW_PX))
    cols = math.ceil(len(labels) / rows)
    legend = fig.legend(handles, labels, loc="outside right upper", fontsize=_TEXT_PT, ncols=cols)
    fig.draw_without_rendering()
    side_px = legend.get_window_extent(fig.canvas.get_renderer()).width
    if side_px > _LEGEND_MAX_SIDE * fig.bbox.width:
        legend.remove()
        cols = max(1, min(len(labels), int((fig.bbox.width - 2 * _PAD_PX) / (side_px / cols))))
        fig.legend(handles, labels, loc="outside lower center", fontsize=_TEXT_PT, ncols=cols)


def _png_bytes(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return buf.getvalue()


def line_figure(series: dict[str, Iterable[tuple[float, float]]], title: str, xlabel: str, ylabel: str,
                width: int = 720, height: int = 420) -> Figure:
    """The figure ``line_chart`` saves: one line per series of (x, y) points, non-finite points dropped."""
    fig = _figure(width, height)
    ax = fig.add_subplot()
    for i, (name, points) in enumerate(series.items()):
        pts = [(float(x), float(y)) for x, y in points]
        pts = [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)]
        ax.plot([x for x, _ in pts], [y for _, y in pts], label=name, color=f"C{i % 10}",
                linestyle=_LINESTYLES[(i // 10) % len(_LINESTYLES)], linewidth=1.6,
                marker="o" if len(pts) <= _MARKER_MAX_POINTS else None, markersize=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=_TEXT_PT)
    if series:
        _legend(fig, ax)
    _fit_text(fig, ax, title)
    return fig


def line_chart(path: str | Path, series: dict[str, Iterable[tuple[float, float]]], title: str, xlabel: str,
               ylabel: str, width: int = 720, height: int = 420) -> Path:
    """Write a ``width`` x ``height`` pixel PNG with one line per series; returns ``path``."""
    return atomic_write_bytes(path, _png_bytes(line_figure(series, title, xlabel, ylabel, width, height)))


def bar_figure(labels: Sequence[str], values: Sequence[float], title: str, ylabel: str,
               width: int = 720, height: int = 420) -> Figure:
    """The figure ``bar_chart`` saves: one bar per label, its value printed above it, the y axis from 0 (or the
    lowest value, if negative).

    A non-finite value is drawn as an empty bar labelled with the value (``nan``), so a missing number is visible.
    """
    if len(labels) != len(values):
        raise ValueError(f"bar chart {title!r}: {len(labels)} labels but {len(values)} values")
    vals = [float(v) for v in values]
    heights = [v if math.isfinite(v) else 0.0 for v in vals]
    fig = _figure(width, height)
    ax = fig.add_subplot()
    bars = ax.bar(range(len(vals)), heights, color="C0", tick_label=list(labels))
    ax.bar_label(bars, labels=[_fmt(v) for v in vals], padding=2, fontsize=_TEXT_PT)
    top = max(heights + [0.0])
    # Headroom of 12 % above the tallest bar keeps its value label inside the axes.
    ax.set_ylim(min(heights + [0.0]) * 1.12, top * 1.12 if top > 0 else 1.0)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.tick_params(labelsize=_TEXT_PT)
    _fit_text(fig, ax, title)
    return fig


def bar_chart(path: str | Path, labels: Sequence[str], values: Sequence[float], title: str, ylabel: str,
              width: int = 720, height: int = 420) -> Path:
    """Write a ``width`` x ``height`` pixel PNG bar chart; returns ``path``."""
    return atomic_write_bytes(path, _png_bytes(bar_figure(labels, values, title, ylabel, width, height)))
