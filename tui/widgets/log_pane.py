"""The log pane: the same tagged lines as headless mode, filterable by tag and level."""

from __future__ import annotations

from collections import deque
from datetime import datetime, tzinfo

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import RichLog, Select

from agora_client.frontend.lines import TAGS, TaggedLine

BUFFER_LINES = 2000
LEVELS = ("debug", "info", "warning", "error")
ALL_TAGS = "*"
OTHER_TAGS = "OTHER"
_TAG_CHOICES = (*TAGS, "STDERR")


def _rank(level: str) -> int:
    return LEVELS.index(level) if level in LEVELS else 1


class LogPane(Vertical):
    def __init__(self, tz: tzinfo | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._tz = tz
        self._lines: deque[TaggedLine] = deque(maxlen=BUFFER_LINES)
        self._wrapped_at = 0  # the width the shown lines were wrapped to

    def compose(self) -> ComposeResult:
        with Horizontal(id="log-filters"):
            yield Select(
                [(f"level ≥ {level}", level) for level in LEVELS],
                value="info",
                allow_blank=False,
                compact=True,
                id="log-level",
            )
            tags = [("all tags", ALL_TAGS), *((tag, tag) for tag in _TAG_CHOICES), ("other tags", OTHER_TAGS)]
            yield Select(tags, value=ALL_TAGS, allow_blank=False, compact=True, id="log-tag")
        yield RichLog(max_lines=BUFFER_LINES, wrap=True, id="log")

    def on_mount(self) -> None:
        self.border_title = "Log"

    def _visible(self, line: TaggedLine) -> bool:
        level = self.query_one("#log-level", Select).value
        tag = self.query_one("#log-tag", Select).value
        if _rank(line.level) < _rank(str(level)):
            return False
        if tag == ALL_TAGS:
            return True
        if tag == OTHER_TAGS:
            return line.tag not in _TAG_CHOICES
        return line.tag == tag

    def _text(self, line: TaggedLine) -> Text:
        theme = self.app.current_theme
        color = {"error": theme.error, "warning": theme.warning}.get(line.level) or theme.accent or theme.primary
        stamp = datetime.fromtimestamp(line.ts, self._tz).strftime("%H:%M:%S")
        return Text.assemble((f"{stamp} ", "dim"), (f"[{line.tag}]", f"bold {color}"), f" {line.text}")

    def _write(self, line: TaggedLine) -> None:
        log = self.query_one("#log", RichLog)
        width = log.scrollable_content_region.width
        log.write(self._text(line), width=width or None)  # wrap to the pane, not to the console's 80 columns
        self._wrapped_at = width

    def on_resize(self, event: events.Resize) -> None:
        # Lines written while the pane was hidden (or narrower) were wrapped to another width: wrap them again.
        self.call_after_refresh(self._rewrap)

    def _rewrap(self) -> None:
        width = self.query_one("#log", RichLog).scrollable_content_region.width
        if width and width != self._wrapped_at:
            self._refill()

    def add(self, line: TaggedLine) -> None:
        self._lines.append(line)
        if self._visible(line):
            self._write(line)

    def on_select_changed(self, event: Select.Changed) -> None:
        self._refill()

    def _refill(self) -> None:
        log = self.query_one("#log", RichLog)
        log.clear()
        for line in self._lines:
            if self._visible(line):
                self._write(line)

    def plain_lines(self) -> list[str]:
        """Every buffered line as text, for the support bundle."""
        return [f"{datetime.fromtimestamp(line.ts, self._tz).isoformat()} {line.render()}" for line in self._lines]
