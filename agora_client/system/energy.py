"""Energy the card used while the worker served, from NVML's cumulative counter, and points per kWh."""

from __future__ import annotations

MJ_PER_KWH = 3.6e9  # 1 kWh = 3.6 MJ = 3.6e9 mJ


class EnergyMeter:
    """Adds up the counter's increases between readings taken while serving; what the card used while the
    worker yielded (a game's energy, say) is not counted. ``kwh`` stays None where the card has no counter."""

    def __init__(self) -> None:
        self._last: int | None = None
        self._used_mj = 0
        self.known = False

    def read(self, counter_mj: int | None, serving: bool) -> None:
        """One reading of the counter; the interval since the last one counts if the worker served through it."""
        if counter_mj is None:
            self._last = None
            return
        if (
            self._last is not None and serving and counter_mj >= self._last
        ):  # a reset counter (driver reload) adds nothing
            self._used_mj += counter_mj - self._last
        self._last, self.known = counter_mj, True

    @property
    def kwh(self) -> float | None:
        return self._used_mj / MJ_PER_KWH if self.known else None

    def points_per_kwh(self, points: float) -> float | None:
        kwh = self.kwh
        return points / kwh if kwh else None
