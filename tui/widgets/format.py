"""Numbers as the panels show them."""

from __future__ import annotations


def points_text(value: float) -> str:
    """Points with as many digits as a small figure needs: a new contributor's 0.0334 is not 0.0."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    if abs(value) >= 0.001:
        return f"{value:.4f}"
    return f"{value:.1e}"


def rate_text(bytes_per_s: float) -> str:
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"
