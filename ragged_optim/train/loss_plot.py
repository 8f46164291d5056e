"""The loss curve as a PNG: matplotlib when installed, else rasterised here (zlib + struct, no dependency)."""

from __future__ import annotations

import math
import struct
import zlib


def write_loss_png(path: str, losses: list[float], val_loss: float | None = None, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _write_png(path, _rasterise_curve(losses, val_loss))
        return
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses, lw=1.2, label="train loss")
    if val_loss is not None:
        ax.axhline(val_loss, color="tab:red", ls="--", lw=1, label=f"val loss {val_loss:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# 3x5 bitmap digits, rows top to bottom, 3 bits per row (MSB = left pixel).
_DIGITS = {
    "0": (7, 5, 5, 5, 7),
    "1": (2, 6, 2, 2, 7),
    "2": (7, 1, 7, 4, 7),
    "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7),
    "6": (7, 4, 7, 5, 7),
    "7": (7, 1, 2, 2, 2),
    "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2),
}


def _rasterise_curve(losses: list[float], val_loss: float | None, w: int = 640, h: int = 360) -> list[bytearray]:
    rows = [bytearray(b"\xff" * (3 * w)) for _ in range(h)]

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            rows[y][3 * x : 3 * x + 3] = bytes(rgb)

    def text(x: int, y: int, s: str, rgb=(60, 60, 60), scale: int = 2) -> None:
        for ch in s:
            for r, bits in enumerate(_DIGITS.get(ch, (0,) * 5)):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        for dy in range(scale):
                            for dx in range(scale):
                                put(x + c * scale + dx, y + r * scale + dy, rgb)
            x += 4 * scale

    def line(x0: int, y0: int, x1: int, y1: int, rgb, thick: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for t in range(thick):
                put(x0, y0 + t, rgb)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    left, right, top, bottom = 48, w - 16, 16, h - 32
    finite = [v for v in losses if math.isfinite(v)]
    if val_loss is not None and math.isfinite(val_loss):
        finite.append(val_loss)
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    lo, hi = math.floor(lo), math.ceil(hi)
    if hi <= lo:
        hi = lo + 1
    n = max(2, len(losses))

    def px(i: int) -> int:
        return left + round((right - left) * i / (n - 1))

    def py(v: float) -> int:
        return bottom - round((bottom - top) * (v - lo) / (hi - lo))

    for tick in range(lo, hi + 1):  # horizontal grid + labels at whole nats
        y = py(tick)
        for x in range(left, right + 1, 2):
            put(x, y, (215, 215, 215))
        text(8, y - 5, str(tick))
    line(left, top, left, bottom, (0, 0, 0))
    line(left, bottom, right, bottom, (0, 0, 0))
    text(right - 8 * len(str(len(losses))), bottom + 10, str(len(losses)))
    text(left, bottom + 10, "1")
    if val_loss is not None and math.isfinite(val_loss):
        y = py(val_loss)
        for x in range(left, right, 10):
            line(x, y, min(x + 5, right), y, (214, 39, 40), thick=2)
    pts = [(px(i), py(v)) for i, v in enumerate(losses) if math.isfinite(v)]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        line(x0, y0, x1, y1, (31, 119, 180), thick=2)
    if len(pts) == 1:
        line(pts[0][0], pts[0][1], pts[0][0] + 1, pts[0][1], (31, 119, 180), thick=2)
    return rows


def _write_png(path: str, rows: list[bytearray]) -> None:
    h, w = len(rows), len(rows[0]) // 3

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(r) for r in rows)  # filter type 0 per scanline
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))  # 8-bit RGB
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
    with open(path, "wb") as f:
        f.write(png)
