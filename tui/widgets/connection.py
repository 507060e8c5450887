"""How the swarm reaches this worker: the address it dialed, from where, by which path, and the network between."""

from __future__ import annotations

from textual.markup import escape
from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import ReachabilityEvent
from agora_client.frontend.lines import network_summary

_PATHS = {"direct": "directly", "mapped": "through your router's port mapping", "relayed": "through a relay", "": ""}


class ConnectionPanel(Widget):
    reachability: reactive[ReachabilityEvent | None] = reactive(None, layout=True)
    """The latest dial-back by the swarm."""

    def on_mount(self) -> None:
        self.border_title = "Connection"

    def render(self) -> str:
        event = self.reachability
        if event is None:
            return "[$text-muted]no dial-back by the swarm reported yet[/]"
        where = escape(event.address or (f"port {event.port}" if event.port is not None else "its port"))
        if event.status == "checking":
            return f"[$text-accent]●[/] the swarm is connecting to [b]{where}[/]..."
        if event.status == "unreachable":
            return f"[$text-error]✖ not reachable[/] at [b]{where}[/]\n[$text-muted]p shows what to open[/]"
        lines = [f"[$text-success]✔ reachable[/] at [b]{where}[/] {_PATHS[event.path]}"]
        if event.path == "relayed":
            lines.append(f"relay {escape(event.relay)}: {escape(event.relay_cost)}")
        if event.tested_from:
            lines.append(f"[$text-muted]tested from {escape(event.tested_from)}[/]")
        lines.append(f"[$text-muted]{escape(network_summary(event.network))}[/]")
        return "\n".join(lines)
