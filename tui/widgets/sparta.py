"""SPARTA averaging: the last round, the success rate over recent rounds and a history chart."""

from __future__ import annotations

from collections import deque

from textual.markup import escape

from agora_client.events import SpartaEvent
from agora_client.frontend.lines import averaged_text
from tui.widgets.chart_panel import ChartPanel

RECENT = 30  # rounds in the success rate


class SpartaPanel(ChartPanel):
    TITLE = "SPARTA averaging"
    EMPTY = "no averaging round yet"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._rounds: deque[SpartaEvent] = deque(maxlen=RECENT)

    def show(self, event: SpartaEvent) -> None:
        self._rounds.append(event)
        if event.ok:  # what was averaged first: the slice and its share of the stage
            weight = " · weight 0 (sync)" if event.weight == 0 else ""
            what = f"round [b]{event.round}[/]: {averaged_text(event)}"
            last = f"{what}\ngroup [b]{event.group_size}[/] · {event.duration_s:.1f}s{weight} · "
        else:
            last = f"[$text-warning]round {event.round} failed: {escape(event.reason or 'no reason given')}[/]\n"
        ok = sum(1 for round_ in self._rounds if round_.ok)
        self.describe(f"{last}{ok}/{len(self._rounds)} recent rounds ok ([b]{ok / len(self._rounds):.0%}[/])")
        self.push("chart", event.group_size if event.ok else 0)  # failed rounds show as gaps
