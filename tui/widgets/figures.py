"""The mission figures as the status band shows them: each one short (a 20-column cell) and long (a wide one)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content
from textual.markup import escape

from agora_client.events import (
    AuthEvent,
    DownloadEvent,
    PointsEvent,
    QueueEvent,
    ResourcesEvent,
    SpartaEvent,
    SwarmEvent,
    SyncEvent,
    YieldEvent,
)
from agora_client.frontend.lines import human_bytes, human_duration
from tui.widgets.format import points_text

WAITING = "[$text-muted]–[/]"
_SYNC_PHASES = {"sync1": ("1", "weights"), "sync2": ("2", "optimizer")}


@dataclass(frozen=True)
class Figure:
    short: str  # markup
    long: str = ""  # markup; empty: the short one says it all

    def fitting(self, width: int) -> str:
        """The long form where it fits ``width`` columns, else the short one."""
        if self.long and _columns(self.long) <= width:
            return self.long
        return self.short


def _size(count: float) -> str:
    """Bytes in at most 6 columns: "480 MB", "1.2 GB"."""
    text = human_bytes(count)
    number, unit = text.split(" ")
    return f"{float(number):.0f} {unit}" if float(number) >= 10 else text


def _rate(per_hour: float) -> str:
    return f"+{per_hour:.0f}/h" if per_hour >= 10 else f"+{per_hour:.2g}/h"


def _columns(markup: str) -> int:
    return Content.from_markup(markup).cell_length


class SpartaTally:
    """SPARTA rounds of this run: how many there were and how many averaged with a peer."""

    def __init__(self) -> None:
        self.ok = self.total = 0
        self.last: SpartaEvent | None = None

    def add(self, event: SpartaEvent) -> None:
        self.total += 1
        self.ok += event.ok
        self.last = event

    @property
    def text(self) -> str:
        return f"{self.ok}/{self.total} ok"


def auth_figure(event: AuthEvent | None) -> Figure:
    if event is None:
        return Figure(WAITING)
    if event.status == "authorizing":
        return Figure("[$text-accent]● asking[/]")
    if event.status == "authorized":
        name = escape(event.identity or "?")
        slot = f" · slot {event.slot}" if event.slot is not None else ""
        return Figure(
            f"[$text-success]✔[/] {name}", f"[$text-success]✔[/] {name} · stage {escape(event.stage or '?')}{slot}"
        )
    return Figure(f"[$text-error]✖ {event.status}[/]", f"[$text-error]✖ {event.status}: {escape(event.message)}[/]")


def download_figure(event: DownloadEvent | None) -> Figure:
    if event is None:
        return Figure(WAITING)
    if event.status in ("verified", "done"):
        return Figure(
            f"[$text-success]✔[/] {_size(event.bytes)}", f"[$text-success]✔[/] {human_bytes(event.bytes)} verified"
        )
    if event.status == "failed":
        return Figure("[$text-error]✖ failed[/]")
    if event.status == "retry":
        return Figure(f"[$text-warning]resuming[/] {human_bytes(event.bytes)}")
    eta = event.eta_s
    if eta is None and event.total and event.rate_bps > 0:
        eta = (event.total - event.bytes) / event.rate_bps
    done = f"[b]{event.bytes / event.total:.0%}[/]" if event.total else f"[b]{human_bytes(event.bytes)}[/]"
    total = f" of {human_bytes(event.total)}" if event.total else ""
    return Figure(
        f"{done} ~{human_duration(eta)}", f"{done}{total} · {human_bytes(event.rate_bps)}/s · ETA {human_duration(eta)}"
    )


def queue_figure(event: QueueEvent | None, admitted: bool) -> Figure:
    """``admitted``: the worker is past the queue (a sync event came)."""
    if admitted or (event is not None and event.position == 0):
        return Figure("[$text-success]✔[/] admitted")
    if event is None:
        return Figure(WAITING)
    wait = human_duration(event.estimated_wait_s)
    return Figure(f"[b]#{event.position}[/] ~{wait}", f"position [b]#{event.position}[/] · wait ~[b]{wait}[/]")


def sync_figure(event: SyncEvent | None, epoch: int | None) -> Figure:
    if event is None:
        return Figure(WAITING)
    if event.phase == "active":
        return Figure("[$text-success]✔ active[/]", f"[$text-success]✔ active[/] since epoch {event.local_epoch}")
    number, what = _SYNC_PHASES[event.phase]
    if event.target_epoch is None:
        return Figure(f"[b]{number}[/] {what}")
    current = epoch if epoch is not None else event.local_epoch
    done = min(event.steps_total, max(0, current - (event.target_epoch - event.steps_total)))
    return Figure(
        f"[b]{number}[/] · {done}/{event.steps_total}", f"[b]{number}[/] {what} · step {done}/{event.steps_total}"
    )


def gpu_figure(event: ResourcesEvent | None) -> Figure:
    if event is None:
        return Figure(WAITING)
    if event.gpu is None:
        ram = human_bytes(event.process_rss)
        return Figure(f"[$text-warning]–[/] RAM {ram}", f"[$text-warning]none[/] · worker RAM {ram}")
    gpu = event.gpu
    used = f"[b]{gpu.memory_used / 1e9:.1f}[/]/{gpu.memory_total / 1e9:.1f} GB"
    util = f" · util {gpu.utilization:.0f}%" if gpu.utilization is not None else ""
    share = f" ({gpu.memory_used / gpu.memory_total:.0%})" if gpu.memory_total else ""
    return Figure(used, f"{used}{share}{util}")


def yield_figure(event: YieldEvent) -> Figure:
    """The GPU cell while the worker yields the GPU to its owner (the GPU panel says why)."""
    if event.state == "left":
        return Figure("[$text-warning]yielded[/]", "[$text-warning]yielded[/] · slot given back")
    kept = f" · slot kept {human_duration(event.grace_left_s)}" if event.grace_left_s is not None else ""
    return Figure("[$text-warning]yielding[/]", f"[$text-warning]yielding[/]{kept}")


def sparta_figure(tally: SpartaTally) -> Figure:
    if not tally.total:
        return Figure(WAITING)
    color = "$text-success" if tally.ok == tally.total else "$text-warning"
    rate = f" ({tally.ok / tally.total:.0%})"
    return Figure(
        f"[{color}][b]{tally.ok}[/b]/{tally.total} ok[/]",
        f"[{color}][b]{tally.ok}[/b]/{tally.total} rounds ok{rate}[/]",
    )


def points_figure(event: PointsEvent | None) -> Figure:
    if event is None:
        return Figure(WAITING)
    total = event.presence + event.compute
    # few digits, but a new contributor's 0.0034 is not 0
    local = f"[b]{total:,.0f}[/]" if total >= 100 else f"[b]{total:.3g}[/]" if total >= 1 else f"[b]{total:.2g}[/]"
    rank = f" · #{event.rank}" if event.rank is not None else ""
    confirmed = f" · confirmed {points_text(event.confirmed)}" if event.confirmed is not None else ""
    return Figure(f"{local} {_rate(event.rate_per_hour)}", f"{local} {_rate(event.rate_per_hour)}{confirmed}{rank}")


def loss_figure(event: SwarmEvent | None) -> Figure:
    if event is None or event.loss is None:
        return Figure(WAITING)
    evaluated = f" · eval {event.eval_loss:.3f}" if event.eval_loss is not None else ""
    return Figure(f"[b]{event.loss:.3f}[/]", f"[b]{event.loss:.3f}[/]{evaluated}")
