"""When a contributor gives its GPU back to the owner.

Flags: ``--yield never|games|always``, ``--active-hours``, ``--yield-grace``.

- ``games`` (the default, for home machines): yield while another program draws on the card, a game or any 3D
  program (NVML's graphics process list); a compute job beside the worker is left to share the card.
- ``always``: yield while any other program uses the card, compute or graphics.
- ``never``: contribute whatever else runs.

The desktop's own programs (display server, compositor, shell, browsers) hold the card all day and never count:
yielding to them would mean never contributing. ``--active-hours 22-08`` contributes only from 22:00 to 08:00
local time (it may wrap midnight); outside them the worker yields. ``agora pause`` yields too, whatever the mode,
until ``agora resume`` (agora_client/system/pause_control.py). A yielding worker drains, keeps its slot for
``--yield-grace`` seconds, and rejoins once the card has been free for ``FREE_FOR_S`` (so that a game's loading
screen, which may leave the card for a moment, does not bounce the worker in and out of the swarm).
"""

from __future__ import annotations

import argparse
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Iterable, Literal, get_args

YieldMode = Literal["never", "games", "always"]
YIELD_MODES: tuple[str, ...] = get_args(YieldMode)
DEFAULT_YIELD: YieldMode = "games"
DEFAULT_GRACE_S = 600.0
FREE_FOR_S = 60.0
PAUSED_REASON = "paused by you (agora pause); agora resume contributes again"
RESUMED_REASON = "resumed by you (agora resume)"
# Programs that hold a desktop's card all day (lower-case names, ".exe" dropped): never a reason to yield.
DESKTOP_PROGRAMS = frozenset(
    {
        "xorg",
        "xwayland",
        "gnome-shell",
        "kwin_x11",
        "kwin_wayland",
        "plasmashell",
        "mutter",
        "sway",
        "hyprland",
        "picom",
        "compiz",
        "xfwm4",
        "cinnamon",
        "muffin",
        "weston",
        "gamescope-wl",
        "dwm",
        "explorer",
        "searchhost",
        "startmenuexperiencehost",
        "shellexperiencehost",
        "textinputhost",
        "firefox",
        "chrome",
        "chromium",
        "msedge",
        "brave",
        "opera",
        "vivaldi",
        "safari",
        "code",
        "slack",
        "discord",
        "steamwebhelper",
        "nautilus",
    }
)
_HOURS = re.compile(r"^(\d{1,2})(?::00)?-(\d{1,2})(?::00)?$")


@dataclass(frozen=True)
class GpuUser:
    """A process NVML lists on the card."""

    pid: int
    name: str
    graphics: bool  # in the graphics list (a game, a 3D program); else compute only

    @property
    def desktop(self) -> bool:
        return self.name.lower().removesuffix(".exe") in DESKTOP_PROGRAMS

    def describe(self) -> str:
        return f"another process is using the GPU: {self.name} pid {self.pid}"


@dataclass(frozen=True)
class ActiveHours:
    """Whole hours of the local day, ``start`` inclusive to ``end`` exclusive; start > end wraps midnight."""

    start: int
    end: int

    def contains(self, when: datetime) -> bool:
        if self.start < self.end:
            return self.start <= when.hour < self.end
        return when.hour >= self.start or when.hour < self.end

    def __str__(self) -> str:
        return f"{self.start:02d}-{self.end:02d}"


def parse_active_hours(text: str) -> ActiveHours:
    """``22-08`` (or ``22:00-08:00``): contribute from 22:00 to 08:00; ValueError that says what to write otherwise."""
    match = _HOURS.match(text.strip())
    example = "e.g. 22-08 to contribute from 22:00 to 08:00 local time"
    if match is None:
        raise ValueError(f"--active-hours {text!r} is not START-END in whole hours, {example}")
    start, end = int(match[1]), int(match[2])
    if start > 24 or end > 24:
        raise ValueError(f"--active-hours {text!r}: hours run from 0 to 24, {example}")
    start, end = start % 24, end % 24  # 24 is midnight
    if start == end:
        raise ValueError(
            f"--active-hours {text!r} is an empty (or a whole) day: leave the option out to contribute all day"
        )
    return ActiveHours(start, end)


class YieldPolicy:
    """Whether to yield now, from NVML's answers and the clock; ``reason`` keeps yielding until the card has been
    free for ``free_for_s`` (hysteresis), while the active hours switch at once."""

    def __init__(self, mode: YieldMode, active_hours: ActiveHours | None = None, *, free_for_s: float = FREE_FOR_S):
        self.mode, self.active_hours, self.free_for_s = mode, active_hours, free_for_s
        self._busy_at: float | None = None  # when another process was last seen (monotonic seconds)
        self._busy_reason = ""
        self._paused = threading.Event()  # set from the control socket's thread, read by the runtime's loop

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def pause(self) -> bool:
        """Yield from now on, whatever the mode, until ``resume``; False when already paused."""
        if self._paused.is_set():
            return False
        self._paused.set()
        return True

    def resume(self) -> bool:
        """Let the mode and the active hours decide again; False when not paused."""
        if not self._paused.is_set():
            return False
        self._paused.clear()
        return True

    @property
    def watches_gpu(self) -> bool:
        return self.mode != "never"

    def other_user(self, users: Iterable[GpuUser], own_pids: set[int]) -> GpuUser | None:
        """The first process that is not ours, not the desktop's, and counts in this mode."""
        if self.mode == "never":
            return None
        for user in users:
            if user.pid not in own_pids and not user.desktop and (self.mode == "always" or user.graphics):
                return user
        return None

    def reason(self, users: Iterable[GpuUser], own_pids: set[int], *, now: float, local_time: datetime) -> str | None:
        """Why to yield now, or None to contribute."""
        if self._paused.is_set():
            return PAUSED_REASON
        if self.active_hours is not None and not self.active_hours.contains(local_time):
            return f"outside active hours {self.active_hours}"
        other = self.other_user(users, own_pids)
        if other is not None:
            self._busy_at, self._busy_reason = now, other.describe()
            return self._busy_reason
        if self._busy_at is not None and now - self._busy_at < self.free_for_s:  # one text: one line, not one a second
            return (
                f"{self._busy_reason}; it has stopped, waiting until the GPU has been free for {self.free_for_s:.0f} s"
            )
        self._busy_at = None
        return None


def _grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--yield-grace {text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"--yield-grace {text!r}: give 0 or more seconds")
    return value


def _active_hours(text: str) -> ActiveHours:
    try:
        return parse_active_hours(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def configure_yield(parser: argparse.ArgumentParser) -> None:
    """--yield, --active-hours and --yield-grace, for the client and the runtime alike."""
    parser.add_argument(
        "--yield",
        dest="yield_mode",
        choices=YIELD_MODES,
        default=DEFAULT_YIELD,
        help="give the GPU back while you use it: games (default: while another program draws on it, a game or a 3D "
        "program; a compute job may share it), always (any other program on it), never. The desktop's own "
        f"programs never count; the worker rejoins once the GPU has been free for {FREE_FOR_S:.0f} s",
    )
    parser.add_argument(
        "--active-hours",
        type=_active_hours,
        default=None,
        metavar="START-END",
        help="contribute only in these local hours, e.g. 22-08 (wraps midnight); outside them, yield",
    )
    parser.add_argument(
        "--yield-grace",
        type=_grace,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help=f"while yielding, keep the swarm slot this long, then give it back and join again later "
        f"(default: {DEFAULT_GRACE_S:.0f})",
    )


def yield_argv(args: argparse.Namespace) -> list[str]:
    """The runtime's command-line words for what ``configure_yield`` parsed."""
    argv = ["--yield", args.yield_mode, "--yield-grace", repr(float(args.yield_grace))]
    if args.active_hours is not None:
        argv += ["--active-hours", str(args.active_hours)]
    return argv


def policy_of(args: argparse.Namespace) -> YieldPolicy:
    return YieldPolicy(args.yield_mode, args.active_hours)
