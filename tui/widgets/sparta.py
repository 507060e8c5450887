"""SPARTA averaging: the last round, the success rate over recent rounds and a history chart."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.markup import escape
from textual.widgets import Sparkline, Static

from agora_client.events import SpartaEvent

HISTORY = 30  # rounds kept for the rate and the chart


class SpartaPanel(Vertical):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._rounds: deque[SpartaEvent] = deque(maxlen=HISTORY)

    def compose(self) -> ComposeResult:
        yield Static("[$text-muted]no averaging round yet[/]", id="sparta-detail")
        yield Sparkline([], id="sparta-chart")

    def on_mount(self) -> None:
        self.border_title = "SPARTA averaging"

    def show(self, event: SpartaEvent) -> None:
        self._rounds.append(event)
        if event.ok:
            weight = " · weight 0 (sync)" if event.weight == 0 else ""
            last = (
                f"round [b]{event.round}[/]: group [b]{event.group_size}[/] · {event.fraction:.1%} averaged"
                f" · {event.duration_s:.1f}s{weight}"
            )
        else:
            last = f"[$text-warning]round {event.round} failed: {escape(event.reason or 'no reason given')}[/]"
        ok = sum(1 for round_ in self._rounds if round_.ok)
        rate = f"{ok}/{len(self._rounds)} recent rounds ok ([b]{ok / len(self._rounds):.0%}[/])"
        self.query_one("#sparta-detail", Static).update(f"{last}\n{rate}")
        # Chart: group size per round, 0 for a failed round, so failures show as gaps.
        self.query_one("#sparta-chart", Sparkline).data = [r.group_size if r.ok else 0 for r in self._rounds]
