"""Tiny dependency-free PNG charts (line and bar) for training curves and acceptance reports.

The design card keeps plotting libraries out of the pipeline; a chart here is an RGB raster with axes, ticks,
labels in a 5x7 bitmap font and a legend, encoded as PNG with zlib. Good enough to read a curve in the Prefect UI
or a report; not a plotting library.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from pathlib import Path

from eagle3.support.io import atomic_write_bytes

# 5x7 glyphs, one string of 7 rows per character, '#' = ink. Lowercase letters render as uppercase.
_FONT_ROWS = {
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "#####...#...#.....#.....##...#.###.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "#####.....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#...#..##..",
    "A": ".###.#...##...#######...##...##...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "###..#..#.#...##...##...##..#.###..",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.", "J": "..###...#....#....#....#.#..#..##..",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#", "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##...##...##...##...#", "N": "#...##...###..##.#.##..###...##...#",
    "O": ".###.#...##...##...##...##...#.###.", "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#", "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".####.....#.....###.....#....#####.", "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.", "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#.#.#.#.", "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..", "Z": "#####....#...#...#...#...#....#####",
    ".": "..............................##...", ",": ".....................##....#...#...",
    "-": "...............###.................", "+": ".......#....#..#####..#....#.......",
    ":": ".....##...##.........##...##.......", "%": "##...##..#...#...#...#...#..##...##",
    "(": "...#...#...#....#....#.....#.....#.", ")": ".#.....#.....#....#....#...#...#...",
    "/": "....#...#....#...#...#....#...#....", "_": "..............................#####",
    "=": "..........#####.....#####..........", " ": "." * 35, "e": "",
    "[": ".###..#....#....#....#....#....###.", "]": ".###....#....#....#....#....#..###.",
    "#": ".#.#..#.#.#####.#.#.#####.#.#..#.#.", "x": "......#...#.#.#...#...#.#.#...#....",
    "'": "..#....#...#.......................", "?": ".###.#...#....#...#...#.......#....",
}
_FONT = {ch: rows for ch, rows in _FONT_ROWS.items() if rows}
_PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
            (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
_INK, _GRID, _BG = (20, 20, 20), (225, 225, 225), (255, 255, 255)


class _Canvas:
    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.px = bytearray(bytes(_BG) * (width * height))

    def set(self, x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i : i + 3] = bytes(rgb)

    def line(self, x0: int, y0: int, x1: int, y1: int, rgb, thick: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for t in range(thick):
                self.set(x0, y0 + t, rgb)
                self.set(x0 + t, y0, rgb)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb) -> None:
        for y in range(min(y0, y1), max(y0, y1) + 1):
            for x in range(min(x0, x1), max(x0, x1) + 1):
                self.set(x, y, rgb)

    def text(self, x: int, y: int, s: str, rgb=_INK, scale: int = 1, vertical: bool = False) -> None:
        for ch in s:
            rows = _FONT.get(ch) or _FONT.get(ch.upper()) or _FONT["?"]
            for r in range(7):
                for c in range(5):
                    if rows[r * 5 + c] == "#":
                        for a in range(scale):
                            for b in range(scale):
                                if vertical:  # rotated 90 degrees counter-clockwise, reading bottom to top
                                    self.set(x + r * scale + a, y - c * scale - b, rgb)
                                else:
                                    self.set(x + c * scale + a, y + r * scale + b, rgb)
            if vertical:
                y -= 6 * scale
            else:
                x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w : 3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 10) for i in range(first, last + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


def _axes(c: _Canvas, title: str, xlabel: str, ylabel: str, x_range, y_range):
    left, right, top, bottom = 70, c.w - 20, 40, c.h - 50
    c.text(left, 12, title, scale=2)
    yt = _nice_ticks(*y_range)
    ylo, yhi = yt[0], yt[-1] if yt[-1] > yt[0] else yt[0] + 1
    for t in yt:
        y = bottom - int((t - ylo) / (yhi - ylo) * (bottom - top))
        c.line(left, y, right, y, _GRID)
        label = _fmt(t)
        c.text(left - 6 - 6 * len(label), y - 3, label)
    if x_range is not None:
        xt = _nice_ticks(*x_range)
        xlo, xhi = xt[0], xt[-1] if xt[-1] > xt[0] else xt[0] + 1
        for t in xt:
            x = left + int((t - xlo) / (xhi - xlo) * (right - left))
            c.line(x, bottom, x, bottom + 4, _INK)
            label = _fmt(t)
            c.text(x - 3 * len(label), bottom + 8, label)
    else:
        xlo = xhi = None
    c.line(left, top, left, bottom, _INK)
    c.line(left, bottom, right, bottom, _INK)
    c.text((left + right) // 2 - 3 * len(xlabel), c.h - 18, xlabel)
    c.text(12, (top + bottom) // 2 + 3 * len(ylabel), ylabel, vertical=True)

    def to_px(x: float, y: float) -> tuple[int, int]:
        px = left + int((x - xlo) / (xhi - xlo) * (right - left)) if xlo is not None else left
        return px, bottom - int((y - ylo) / (yhi - ylo) * (bottom - top))

    return to_px, (left, right, top, bottom)


def line_chart(path: str | Path, series: dict[str, list[tuple[float, float]]], title: str, xlabel: str,
               ylabel: str, width: int = 720, height: int = 420) -> Path:
    """One polyline per series (points are (x, y)); legend in the top-right corner. Non-finite points are skipped."""
    pts = {k: [(float(x), float(y)) for x, y in v if math.isfinite(x) and math.isfinite(y)] for k, v in series.items()}
    xs = [x for v in pts.values() for x, _ in v] or [0.0, 1.0]
    ys = [y for v in pts.values() for _, y in v] or [0.0, 1.0]
    c = _Canvas(width, height)
    to_px, (_left, right, top, _bottom) = _axes(c, title, xlabel, ylabel, (min(xs), max(xs)), (min(ys), max(ys)))
    for i, (name, v) in enumerate(pts.items()):
        rgb = _PALETTE[i % len(_PALETTE)]
        for (x0, y0), (x1, y1) in itertools.pairwise(v):
            c.line(*to_px(x0, y0), *to_px(x1, y1), rgb, thick=2)
        if len(v) == 1:
            px, py = to_px(*v[0])
            c.rect(px - 2, py - 2, px + 2, py + 2, rgb)
        lx, ly = right - 6 * max(len(n) for n in pts) - 24, top + 6 + 12 * i
        c.rect(lx, ly + 1, lx + 10, ly + 5, rgb)
        c.text(lx + 16, ly, name)
    return atomic_write_bytes(path, c.png())


def bar_chart(path: str | Path, labels: list[str], values: list[float], title: str, ylabel: str,
              width: int = 720, height: int = 420) -> Path:
    """Vertical bars with their value printed above each bar; the y axis starts at 0."""
    vals = [float(v) if math.isfinite(float(v)) else 0.0 for v in values]
    c = _Canvas(width, height)
    to_px, (left, right, _top, bottom) = _axes(c, title, "", ylabel, None, (0.0, max(vals + [1e-9])))
    n = max(1, len(vals))
    slot = (right - left) / n
    for i, (label, v) in enumerate(zip(labels, vals)):
        x0 = left + int(i * slot + slot * 0.15)
        x1 = left + int((i + 1) * slot - slot * 0.15)
        _, y = to_px(0, v)
        c.rect(x0, y, x1, bottom - 1, _PALETTE[0])
        txt = _fmt(v)
        c.text((x0 + x1) // 2 - 3 * len(txt), y - 10, txt)
        c.text((x0 + x1) // 2 - 3 * len(label), bottom + 8, label)
    return atomic_write_bytes(path, c.png())
