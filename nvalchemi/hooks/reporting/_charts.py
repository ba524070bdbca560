"""Tiny text line charts drawn with Unicode braille dots (2x4 dots per character)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["braille_chart", "sparkline"]

_BRAILLE = 0x2800
# Dot bit for (row 0..3, column 0..1) inside one braille cell.
_DOTS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))
_BLOCKS = "▁▂▃▄▅▆▇█"


def _resample(values: Sequence[float], count: int) -> list[float]:
    """``count`` bucket means of ``values`` (or ``values`` itself when shorter)."""
    if len(values) <= count:
        return list(values)
    out = []
    for i in range(count):
        start = i * len(values) // count
        stop = max((i + 1) * len(values) // count, start + 1)
        bucket = values[start:stop]
        out.append(sum(bucket) / len(bucket))
    return out


def _scaled(values: Sequence[float], log: bool) -> list[float]:
    finite = [v for v in values if math.isfinite(v)]
    if log and finite and all(v > 0 for v in finite):
        return [math.log10(v) for v in finite]
    return finite


def braille_chart(
    values: Sequence[float], *, width: int, height: int, log: bool = False
) -> list[str]:
    """``height`` lines of ``width`` braille characters tracing ``values`` left to right.

    Non-finite values are dropped; ``log`` plots ``log10`` when every value is
    positive. A single value draws one dot; a flat series a flat line.

    Example:
        >>> lines = braille_chart([3.0, 2.0, 1.0], width=4, height=2)
        >>> len(lines), all(len(line) == 4 for line in lines)
        (2, True)
    """
    width, height = max(int(width), 1), max(int(height), 1)
    points = _resample(_scaled(values, log), width * 2)
    cells = [[0] * width for _ in range(height)]
    if points:
        rows = height * 4
        low, high = min(points), max(points)
        span = high - low

        def row_of(value: float) -> int:
            if span <= 0:
                return rows // 2
            return rows - 1 - round((value - low) / span * (rows - 1))

        columns = width * 2
        step = (columns - 1) / (len(points) - 1) if len(points) > 1 else 0.0
        previous: tuple[int, int] | None = None
        for index, value in enumerate(points):
            x, y = round(index * step), row_of(value)
            if previous is None:
                _dot(cells, x, y)
            else:
                _segment(cells, previous, (x, y))
            previous = (x, y)
    return ["".join(chr(_BRAILLE + c) for c in row) for row in cells]


def _dot(cells: list[list[int]], x: int, y: int) -> None:
    cells[y // 4][x // 2] |= _DOTS[y % 4][x % 2]


def _segment(cells: list[list[int]], start: tuple[int, int], end: tuple[int, int]) -> None:
    (x0, y0), (x1, y1) = start, end
    steps = max(abs(x1 - x0), abs(y1 - y0), 1)
    for i in range(steps + 1):
        _dot(cells, round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps))


def sparkline(values: Sequence[float], *, width: int = 24, log: bool = False) -> str:
    """One line of block characters (``▁▂▃▄▅▆▇█``) for a compact trend.

    Example:
        >>> sparkline([1, 2, 3, 4], width=4)
        '▁▃▆█'
    """
    points = _resample(_scaled(values, log), max(int(width), 1))
    if not points:
        return ""
    low, high = min(points), max(points)
    if high <= low:
        return _BLOCKS[len(_BLOCKS) // 2] * len(points)
    top = len(_BLOCKS) - 1
    return "".join(_BLOCKS[round((v - low) / (high - low) * top)] for v in points)
