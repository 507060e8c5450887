"""SPARTA averaging.

The last round, the rounds that averaged of all this run's, and the group of each round over time."""

from __future__ import annotations

from textual.markup import escape

from agora_client.events import SpartaEvent
from agora_client.frontend.lines import averaged_text
from tui.widgets.chart import Series
from tui.widgets.chart_panel import ChartPanel
from tui.widgets.figures import SpartaTally


class SpartaPanel(ChartPanel):
    TITLE = "SPARTA averaging"
    EMPTY = "no averaging round yet"
    Y_LABEL = "group"
    SERIES = {"group": Series("group", "primary")}

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.tally = SpartaTally()

    def show(self, event: SpartaEvent) -> None:
        self.tally.add(event)
        if event.ok:  # what was averaged first: the slice and its share of the stage
            weight = " · weight 0 (sync)" if event.weight == 0 else ""
            last = (
                f"round [b]{event.round}[/]: {averaged_text(event)}\n"
                f"group [b]{event.group_size}[/] · {event.duration_s:.1f}s{weight} · "
            )
        else:
            last = f"[$text-warning]round {event.round} failed: {escape(event.reason or 'no reason given')}[/]\n"
        tally = self.tally
        self.describe(f"{last}[b]{tally.ok}/{tally.total}[/] rounds ok ({tally.ok / tally.total:.0%})")
        self.push("group", event.ts, event.group_size if event.ok else 0)  # a failed round drops to 0
        self.draw()
