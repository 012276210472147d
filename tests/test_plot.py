import math
import struct
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from eagle3.support.plot import bar_chart, bar_figure, line_chart, line_figure

NAN, INF = float("nan"), float("inf")
# 160 characters: the old 5x7-font writer drew titles at 12 px a character from x=70 and cut this one off at ~54.
LONG_TITLE = ("Draft training loss (KL divergence between the verifier's and the draft's next-token distributions) "
              "for every test-time-training step, weighted and unweighted")


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature and that chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    (n,) = struct.unpack(">I", data[8:12])
    kind, body = data[12:16], data[16 : 16 + n]
    assert kind == b"IHDR"
    assert struct.unpack(">I", data[16 + n : 20 + n])[0] == zlib.crc32(kind + body) & 0xFFFFFFFF
    return struct.unpack(">II", body[:8])


def _inside(box, fig) -> bool:
    return box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height


def _series(n: int, points: int = 50) -> dict[str, list[tuple[float, float]]]:
    return {f"series {j}": [(x, math.exp(-x / 20) + 0.1 * j) for x in range(points)] for j in range(n)}


@pytest.mark.parametrize("size", [(720, 420), (301, 199), (1283, 517)])
def test_line_chart_writes_a_png_of_the_requested_pixel_size(tmp_path, size):
    p = line_chart(tmp_path / "c.png", _series(2), "Loss", "step", "nats", width=size[0], height=size[1])
    assert p == tmp_path / "c.png"
    assert _png_size(p.read_bytes()) == size
    assert not list(tmp_path.glob(".*tmp"))  # the atomic writer's temp file is gone


def test_bar_chart_writes_a_png_of_the_requested_pixel_size(tmp_path):
    p = bar_chart(tmp_path / "b.png", ["pos 1", "pos 2"], [0.7, 0.4], "Acceptance", "rate", width=333, height=222)
    assert _png_size(p.read_bytes()) == (333, 222)
    assert _png_size(bar_chart(tmp_path / "d.png", ["a"], [1.0], "t", "y").read_bytes()) == (720, 420)


@pytest.mark.parametrize("size,n_series,label_repeat", [((720, 420), 9, 4), ((360, 240), 2, 1)])
def test_a_long_title_and_labels_lie_wholly_inside_the_image(size, n_series, label_repeat):
    fig = line_figure(_series(n_series), LONG_TITLE, "optimizer step " * label_repeat,
                      "tokens per verifier step " * label_repeat, *size)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    fig.draw_without_rendering()
    for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
        assert _inside(text.get_window_extent(renderer), fig), text.get_text()
    assert "".join(ax.title.get_text().split()) == "".join(LONG_TITLE.split())  # wrapped, not cut
    assert not ax.title.get_window_extent(renderer).overlaps(fig.legends[0].get_window_extent(renderer))
    fig = bar_figure(["pos 1"], [0.5], LONG_TITLE, "acceptance rate", *size)
    fig.draw_without_rendering()
    assert _inside(fig.axes[0].title.get_window_extent(fig.canvas.get_renderer()), fig)


@pytest.mark.parametrize("n_series,size", [(2, (720, 420)), (16, (720, 420)), (16, (360, 240))])
def test_the_legend_never_covers_a_line(n_series, size):
    fig = line_figure(_series(n_series), "Loss", "step", "nats", *size)
    renderer = fig.canvas.get_renderer()
    fig.draw_without_rendering()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert _inside(box, fig)
    assert len(legend.get_texts()) == n_series
    ax = fig.axes[0]
    assert not box.overlaps(ax.get_window_extent(renderer))
    for line in ax.get_lines():
        xy = ax.transData.transform(line.get_xydata())  # display pixels
        assert not any(box.contains(x, y) for x, y in xy), line.get_label()


def test_non_finite_points_are_dropped():
    fig = line_figure({"a": [(0, 1.0), (1, NAN), (2, 0.5), (INF, 0.2), (3, -INF), (4, 0.25)], "b": [(0, 2.0)]},
                      "Loss", "step", "nats")
    a, b = fig.axes[0].get_lines()
    assert a.get_xydata().tolist() == [[0, 1.0], [2, 0.5], [4, 0.25]]
    assert b.get_xydata().tolist() == [[0, 2.0]]
    assert b.get_marker() == "o"  # a single point is drawn, not an invisible zero-length line


def test_an_empty_series_dict_still_writes_a_valid_png(tmp_path):
    p = line_chart(tmp_path / "e.png", {}, "Nothing yet", "step", "loss", width=400, height=300)
    assert _png_size(p.read_bytes()) == (400, 300)
    assert not line_figure({}, "Nothing yet", "step", "loss").legends


def test_bar_values_are_printed_above_their_bars_and_the_y_axis_starts_at_zero():
    fig = bar_figure(["pos 1", "pos 2", "pos 3"], [0.8123, 0.4, NAN], "Acceptance", "rate")
    ax = fig.axes[0]
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    texts = {t.get_text(): t.get_window_extent(renderer) for t in ax.texts}
    assert set(texts) == {"0.812", "0.4", "nan"}
    bars = ax.patches
    assert [round(b.get_height(), 4) for b in bars] == [0.8123, 0.4, 0.0]
    for (label, box), bar in zip(texts.items(), bars):
        top = bar.get_window_extent(renderer)
        assert box.y0 >= top.y1 - 1 and top.x0 <= (box.x0 + box.x1) / 2 <= top.x1, label
        assert _inside(box, fig)
    assert ax.get_ylim()[0] == 0
    assert [t.get_text() for t in ax.get_xticklabels()] == ["pos 1", "pos 2", "pos 3"]


def test_bar_chart_labels_and_values_must_match(tmp_path):
    with pytest.raises(ValueError, match="2 labels but 3 values"):
        bar_chart(tmp_path / "b.png", ["a", "b"], [1, 2, 3], "Acceptance", "rate")
    assert not list(tmp_path.iterdir())


def test_charts_are_deterministic_and_drawable_from_threads(tmp_path):
    def draw(i: int) -> bytes:
        return line_chart(tmp_path / f"{i}.png", _series(3), LONG_TITLE, "step", "nats").read_bytes()

    serial = draw(-1)
    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(draw, range(8))) == {serial}


def test_the_module_never_imports_pyplot(tmp_path):
    code = ("import sys; from eagle3.support.plot import line_chart, bar_chart; "
            f"line_chart({str(tmp_path / 'l.png')!r}, {{'a': [(0, 1), (1, 2)]}}, 't', 'x', 'y'); "
            f"bar_chart({str(tmp_path / 'b.png')!r}, ['a'], [1], 't', 'y'); "
            "print('matplotlib.pyplot' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])  # this checkout's eagle3, first on sys.path
    assert out.stdout.strip() == "False"
