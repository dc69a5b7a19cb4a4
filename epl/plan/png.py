"""A small RGB raster and its PNG encoding (zlib + struct, no imaging library).

The planner's chart (``epl.plan.chart``) must render wherever EPL runs, and EPL adds
no runtime dependency for it: this is just enough drawing for a chart (pixels,
lines, filled rectangles, text in a built-in 5 x 7 bitmap font) and the PNG format
(signature, IHDR, one IDAT of filter-0 scanlines, IEND; each chunk with its CRC).
"""
import struct
import zlib

# 5 x 7 glyphs: 7 rows of 5 bits, the top row first ("#" = ink).  Letters are drawn
# upper case; characters without a glyph are drawn as "?".
_FONT_ROWS = {
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "#####...#...#.....#.....##...#.###.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "######....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#...#..##..",
    "A": ".###.#...##...#######...##...##...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "###..#..#.#...##...##...##..#.###..",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.", "J": "..###...#....#....#....##..#..##...",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#", "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##.#.##...##...##...#", "N": "#...##...###..##.#.##..###...##...#",
    "O": ".###.#...##...##...##...##...#.###.", "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#", "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".#####....#.....###.....#....#####.", "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.", "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#.#.#.#.", "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..", "Z": "#####....#...#...#...#...#....#####",
    ".": "...............................##..", ",": "..........................##...#...",
    ":": "......##...##.........##...##......", "/": "....#....#...#...#...#...#....#....",
    "-": "...............#####...............", "+": "......#....#..#####..#....#........",
    "%": "##...##..#...#...#...#...#..##...##", "(": "...#...#...#....#....#.....#.....#.",
    ")": ".#.....#.....#....#....#...#...#...",
    "=": "..........#####.....#####..........", "_": "..............................#####",
    " ": "...................................", "?": ".###.#...#....#...#...#.........#..",
    "<": "...#...#...#...#.....#.....#.....#.", ">": ".#.....#.....#.....#...#...#...#...",
    "'": "..#....#...#.......................", "[": ".###..#....#....#....#....#....###.",
    "]": ".###....#....#....#....#....#..###.",
}
GLYPH_W, GLYPH_H = 5, 7


def _glyph(ch):
    key = ch.upper() if ch.isalpha() else ch
    return _FONT_ROWS.get(key, _FONT_ROWS["?"])


class Canvas(object):
    """``width`` x ``height`` RGB pixels (row-major bytearray), white to begin with."""

    def __init__(self, width, height, background=(255, 255, 255)):
        self.width, self.height = int(width), int(height)
        self.pixels = bytearray(bytes(bytearray(background)) * (self.width * self.height))

    def get(self, x, y):
        i = 3 * (y * self.width + x)
        return tuple(self.pixels[i:i + 3])

    def set(self, x, y, color):
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytearray(color)

    def rect(self, x0, y0, x1, y1, color):
        """Fill the pixels x0..x1, y0..y1 (inclusive, any order, clipped)."""
        xa, xb = sorted((int(round(x0)), int(round(x1))))
        ya, yb = sorted((int(round(y0)), int(round(y1))))
        xa, xb = max(xa, 0), min(xb, self.width - 1)
        row = bytearray(color) * max(0, xb - xa + 1)
        for y in range(max(ya, 0), min(yb, self.height - 1) + 1):
            i = 3 * (y * self.width + xa)
            self.pixels[i:i + len(row)] = row

    def line(self, x0, y0, x1, y1, color, width=1):
        """A straight line (Bresenham), ``width`` pixels thick."""
        x0, y0, x1, y1 = (int(round(v)) for v in (x0, y0, x1, y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, half = dx + dy, (width - 1) // 2
        while True:
            self.rect(x0 - half, y0 - half, x0 - half + width - 1, y0 - half + width - 1,
                      color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x, y, s, color=(0, 0, 0), scale=1, align="left"):
        """``s`` with its top-left at (x, y) (``align`` "right"/"center": that end
        at x); each glyph 5 x 7 pixels x ``scale``, one column apart."""
        w = text_width(s, scale)
        x = x - w if align == "right" else x - w // 2 if align == "center" else x
        for ch in s:
            rows = _glyph(ch)
            for r in range(GLYPH_H):
                for c in range(GLYPH_W):
                    if rows[r * GLYPH_W + c] == "#":
                        self.rect(x + c * scale, y + r * scale, x + c * scale + scale - 1,
                                  y + r * scale + scale - 1, color)
            x += (GLYPH_W + 1) * scale

    def to_png(self):
        """The PNG bytes: 8-bit RGB, no interlace, every scanline with filter 0."""
        raw = bytearray()
        stride = 3 * self.width
        for y in range(self.height):
            raw.append(0)
            raw.extend(self.pixels[y * stride:(y + 1) * stride])
        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
                + _chunk(b"IDAT", zlib.compress(bytes(raw), 9)) + _chunk(b"IEND", b""))

    def save(self, path):
        with open(path, "wb") as f:
            f.write(self.to_png())


def text_width(s, scale=1):
    return max(0, len(s) * (GLYPH_W + 1) - 1) * scale


def _chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(
        ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def read_png(data):
    """(width, height, RGB bytearray) of a PNG this module wrote (8-bit RGB, filter 0
    or any of the five filters); checks the signature and every chunk's CRC."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG: bad signature")
    at, chunks = 8, []
    while at < len(data):
        n, = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + n]
        crc, = struct.unpack(">I", data[at + 8 + n:at + 12 + n])
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise ValueError("PNG chunk %r: bad CRC" % kind)
        chunks.append((kind, body))
        at += 12 + n
    if chunks[0][0] != b"IHDR" or chunks[-1][0] != b"IEND":
        raise ValueError("PNG: IHDR must come first and IEND last")
    w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    if (depth, ctype, interlace) != (8, 2, 0):
        raise ValueError("PNG: only 8-bit RGB without interlace is read here")
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 3 * w
    if len(raw) != h * (stride + 1):
        raise ValueError("PNG: IDAT holds %d bytes, %d expected" % (len(raw), h * (stride + 1)))
    out, prev = bytearray(), bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - 3] if i >= 3 else 0
            b, c = prev[i], prev[i - 3] if i >= 3 else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out.extend(line)
        prev = line
    return w, h, out
