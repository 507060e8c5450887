"""The join path: Authorization -> Download -> Queue -> Sync 1 -> Sync 2 -> Active."""

from __future__ import annotations

from textual.markup import escape
from textual.reactive import reactive
from textual.widget import Widget

from tui.state import LABELS, Failure, JoinStep

_SEPARATOR = " [$text-muted]›[/] "


class Stepper(Widget):
    step: reactive[JoinStep] = reactive(JoinStep.AUTHORIZATION, layout=True)
    """The step the worker is in."""
    failure: reactive[Failure | None] = reactive(None, layout=True)
    """The failed step with its reason and advice, if any."""
    status: reactive[str] = reactive("", layout=True)
    """One line on what is happening now."""

    def show(self, step: JoinStep, failure: Failure | None, status: str) -> None:
        self.step, self.failure, self.status = step, failure, status

    def _label(self, step: JoinStep) -> str:
        label = LABELS[step]
        if self.failure is not None and step == self.failure.step:
            return f"[$text-error b]✖ {label}[/]"
        if step < self.step:
            return f"[$text-success]✔ {label}[/]"
        if step == self.step and self.failure is None:
            style = "$text-success b" if step == JoinStep.ACTIVE else "reverse $text-accent b"
            return f"[{style}] ● {label} [/]"
        return f"[$text-muted]○ {label}[/]"

    def render(self) -> str:
        steps = _SEPARATOR.join(self._label(step) for step in JoinStep)
        if self.failure is not None:
            detail = (
                f"[$text-error b]{_failed_part(self.failure)} failed:[/] {escape(self.failure.reason)}\n"
                f"[b]What to do:[/] {escape(self.failure.advice)}"
            )
        else:
            detail = f"[$text-muted]{escape(self.status)}[/]"
        return f"{steps}\n{detail}"


def _failed_part(failure: Failure) -> str:
    return "Starting the worker" if failure.step is None else LABELS[failure.step]
