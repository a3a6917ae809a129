"""A tiny line-plot writer to PNG with no dependencies beyond the standard library (zlib), so the
docs' figures can be regenerated in the project's environment as it is (no matplotlib).

    plot = LinePlot(640, 400, x_label="sigma_rel", y_label="validation loss")
    plot.series([...xs], [...ys], color=(31, 119, 180), label="post-hoc", markers=True)
    plot.hline(0.87, color=(150, 150, 150), label="raw weights")
    plot.save("out.png")
"""

from __future__ import annotations

import itertools
import struct
import zlib

# 5 x 7 bitmap glyphs ('#' = ink), enough for axis labels, ticks and legends.
_GLYPHS = {
    "0": [" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "],
    "1": ["  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    "2": [" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"],
    "3": ["#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "],
    "4": ["   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "],
    "5": ["#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "],
    "6": ["  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "],
    "7": ["#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "],
    "8": [" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "],
    "9": [" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "],
    ".": ["     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "],
    ",": ["     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "],
    "-": ["     ", "     ", "     ", " ### ", "     ", "     ", "     "],
    "_": ["     ", "     ", "     ", "     ", "     ", "     ", "#####"],
    "=": ["     ", "     ", "#####", "     ", "#####", "     ", "     "],
    "(": ["   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "],
    ")": [" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "],
    ":": ["     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "],
    "/": ["    #", "    #", "   # ", "  #  ", " #   ", "#    ", "#    "],
    " ": ["     "] * 7,
    "a": ["     ", "     ", " ### ", "    #", " ####", "#   #", " ####"],
    "b": ["#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#### "],
    "c": ["     ", "     ", " ### ", "#    ", "#    ", "#   #", " ### "],
    "d": ["    #", "    #", " ## #", "#  ##", "#   #", "#   #", " ####"],
    "e": ["     ", "     ", " ### ", "#   #", "#####", "#    ", " ### "],
    "f": ["  ## ", " #  #", " #   ", "###  ", " #   ", " #   ", " #   "],
    "g": ["     ", " ####", "#   #", "#   #", " ####", "    #", " ### "],
    "h": ["#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#   #"],
    "i": ["  #  ", "     ", " ##  ", "  #  ", "  #  ", "  #  ", " ### "],
    "k": ["#    ", "#    ", "#  # ", "# #  ", "##   ", "# #  ", "#  # "],
    "l": [" ##  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    "m": ["     ", "     ", "## # ", "# # #", "# # #", "#   #", "#   #"],
    "n": ["     ", "     ", "# ## ", "##  #", "#   #", "#   #", "#   #"],
    "o": ["     ", "     ", " ### ", "#   #", "#   #", "#   #", " ### "],
    "p": ["     ", "     ", "#### ", "#   #", "#### ", "#    ", "#    "],
    "r": ["     ", "     ", "# ## ", "##  #", "#    ", "#    ", "#    "],
    "s": ["     ", "     ", " ####", "#    ", " ### ", "    #", "#### "],
    "t": [" #   ", " #   ", "###  ", " #   ", " #   ", " #  #", "  ## "],
    "u": ["     ", "     ", "#   #", "#   #", "#   #", "#  ##", " ## #"],
    "v": ["     ", "     ", "#   #", "#   #", "#   #", " # # ", "  #  "],
    "w": ["     ", "     ", "#   #", "#   #", "# # #", "# # #", " # # "],
    "x": ["     ", "     ", "#   #", " # # ", "  #  ", " # # ", "#   #"],
    "y": ["     ", "     ", "#   #", "#   #", " ####", "    #", " ### "],
    "A": [" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
    "E": ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"],
    "M": ["#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"],
}


def _png(width: int, height: int, rgb: bytearray) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    stride = 3 * width
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                               0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class LinePlot:
    def __init__(self, width: int, height: int, *, x_label: str, y_label: str, title: str = "",
                 legend_y: float | None = None):
        """``legend_y``: the y value where the legend's top sits (None: the top of the plot)."""
        self.w, self.h = width, height
        self.legend_y = legend_y
        self.x_label, self.y_label, self.title = x_label, y_label, title
        self.items: list[tuple] = []

    def series(self, xs, ys, *, color, label, markers=False, line=True):
        self.items.append(("series", list(xs), list(ys), color, label, markers, line))

    def hline(self, y, *, color, label):
        self.items.append(("hline", y, color, label))

    # --- raster -----------------------------------------------------------------------------------

    def _px(self, x, y, c):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.buf[i:i + 3] = bytes(c)

    def _rect(self, x0, y0, x1, y1, c):
        for y in range(int(y0), int(y1) + 1):
            for x in range(int(x0), int(x1) + 1):
                self._px(x, y, c)

    def _line(self, x0, y0, x1, y1, c, width=2):
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for s in range(steps + 1):
            x = x0 + (x1 - x0) * s / steps
            y = y0 + (y1 - y0) * s / steps
            self._rect(x - width // 2, y - width // 2, x - width // 2 + width - 1,
                       y - width // 2 + width - 1, c)

    def _text(self, x, y, s, c=(0, 0, 0), scale=2, vertical=False):
        for k, ch in enumerate(s):
            glyph = _GLYPHS.get(ch, _GLYPHS[" "])
            for gy, row in enumerate(glyph):
                for gx, ink in enumerate(row):
                    if ink != "#":
                        continue
                    if vertical:  # rotated 90 degrees counter-clockwise, reading upwards
                        px, py = x + gy * scale, y - (k * 6 + gx) * scale
                    else:
                        px, py = x + (k * 6 + gx) * scale, y + gy * scale
                    self._rect(px, py, px + scale - 1, py + scale - 1, c)

    @staticmethod
    def _ticks(lo, hi, n=5):
        import math
        span = hi - lo
        step = 10 ** math.floor(math.log10(span / n))
        for m in (1, 2, 5, 10):
            if span / (step * m) <= n:
                step *= m
                break
        first = math.ceil(lo / step) * step
        ticks, t = [], first
        while t <= hi + 1e-12:
            ticks.append(round(t, 10))
            t += step
        return ticks, step

    def save(self, path: str) -> None:
        self.buf = bytearray(b"\xff" * (3 * self.w * self.h))
        left, right, top, bottom = 90, 20, 40 if self.title else 20, 60
        xs = [x for it in self.items if it[0] == "series" for x in it[1]]
        ys = [y for it in self.items if it[0] == "series" for y in it[2]]
        ys += [it[1] for it in self.items if it[0] == "hline"]
        x_lo, x_hi = min(xs), max(xs)
        y_lo, y_hi = min(ys), max(ys)
        pad = (y_hi - y_lo) * 0.08 or 0.01
        y_lo, y_hi = y_lo - pad, y_hi + pad
        pw, ph = self.w - left - right, self.h - top - bottom

        def X(x):
            return left + (x - x_lo) / (x_hi - x_lo) * pw

        def Y(y):
            return top + (1 - (y - y_lo) / (y_hi - y_lo)) * ph

        grid, axis = (225, 225, 225), (0, 0, 0)
        xt, xstep = self._ticks(x_lo, x_hi, 6)
        yt, ystep = self._ticks(y_lo, y_hi, 6)
        for t in xt:
            self._line(X(t), top, X(t), top + ph, grid, 1)
            label = f"{t:.{max(0, -int(f'{xstep:e}'.split('e')[1]))}f}"
            self._text(int(X(t)) - len(label) * 6, top + ph + 8, label)
        for t in yt:
            self._line(left, Y(t), left + pw, Y(t), grid, 1)
            label = f"{t:.{max(0, -int(f'{ystep:e}'.split('e')[1]))}f}"
            self._text(left - 8 - len(label) * 12, int(Y(t)) - 7, label)
        self._line(left, top + ph, left + pw, top + ph, axis, 2)
        self._line(left, top, left, top + ph, axis, 2)
        self._text(left + pw // 2 - len(self.x_label) * 6, self.h - 24, self.x_label)
        self._text(8, top + ph // 2 + len(self.y_label) * 6, self.y_label, vertical=True)
        if self.title:
            self._text(left, 10, self.title)
        legend_y = top + 8 if self.legend_y is None else int(Y(self.legend_y))
        for it in self.items:
            if it[0] == "hline":
                _, y, color, label = it
                self._line(left, Y(y), left + pw, Y(y), color, 2)
            else:
                _, sx, sy, color, label, markers, line = it
                pts = sorted(zip(sx, sy))
                if line:
                    for (a, b), (c, d) in itertools.pairwise(pts):
                        self._line(X(a), Y(b), X(c), Y(d), color, 3)
                if markers:
                    for a, b in pts:
                        self._rect(X(a) - 4, Y(b) - 4, X(a) + 4, Y(b) + 4, color)
            lx = left + pw - 300
            self._rect(lx, legend_y + 4, lx + 24, legend_y + 9, it[-4] if it[0] == "series"
                       else it[2])
            self._text(lx + 32, legend_y, label)
            legend_y += 20
        with open(path, "wb") as f:
            f.write(_png(self.w, self.h, self.buf))
