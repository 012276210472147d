import struct
import zlib

from eagle3.plot import _FONT, bar_chart, line_chart


def _decode_png(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h = header[:2]
    raw = zlib.decompress(idat)
    assert len(raw) == h * (1 + 3 * w)
    return w, h, raw


def test_font_glyphs_are_5x7():
    assert all(len(rows) == 35 for rows in _FONT.values())


def test_line_chart_is_a_valid_png_with_ink(tmp_path):
    p = line_chart(tmp_path / "c.png", {"a": [(0, 1.0), (1, 0.5), (2, float("nan"))], "b": [(0, 2.0)]},
                   "Loss", "step", "nats", width=300, height=200)
    w, h, raw = _decode_png(p.read_bytes())
    assert (w, h) == (300, 200)
    series_blue = bytes((31, 119, 180))
    assert series_blue in raw  # the first series was drawn


def test_bar_chart_valid_png(tmp_path):
    p = bar_chart(tmp_path / "b.png", ["pos 0", "pos 1"], [0.7, 0.4], "Acceptance", "rate")
    w, h, _ = _decode_png(p.read_bytes())
    assert (w, h) == (720, 420)
    assert not list(tmp_path.glob(".*tmp"))
