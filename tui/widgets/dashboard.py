"""The tabs below the status band: Contribution (this worker), Swarm (every stage, the swarm's learning),
Network (bandwidth, how the swarm reaches the worker) and Log; each event goes to the panels it feeds."""

from __future__ import annotations

from datetime import tzinfo

from textual.app import ComposeResult
from textual.containers import Grid, Vertical, VerticalScroll
from textual.widgets import TabbedContent, TabPane

from agora_client.events import (
    AuthEvent,
    DownloadEvent,
    EnergyEvent,
    Event,
    PointsEvent,
    QueueEvent,
    ReachabilityEvent,
    ResourcesEvent,
    SpartaEvent,
    StageEvent,
    StepEvent,
    SwarmEvent,
    SyncEvent,
    TrafficEvent,
    YieldEvent,
)
from tui.widgets.connection import ConnectionPanel
from tui.widgets.gpu import GpuPanel
from tui.widgets.identity import IdentityPanel
from tui.widgets.join_panel import JoinPanel
from tui.widgets.loss import LossPanel
from tui.widgets.network import NetworkPanel
from tui.widgets.points import PointsPanel
from tui.widgets.share import SharePanel
from tui.widgets.sparta import SpartaPanel
from tui.widgets.stages import StagesPanel
from tui.widgets.tokens import TokensPanel
from tui.widgets.training import TrainingPanel

TABS = {"tab-contribution": "Contribution", "tab-swarm": "Swarm", "tab-network": "Network", "tab-log": "Log"}
LOG_TAB = "tab-log"


class Dashboard(Vertical):
    def __init__(self, tz: tzinfo | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.tz = tz

    def compose(self) -> ComposeResult:
        titles = [f"{number} {title}" for number, title in enumerate(TABS.values(), start=1)]  # the keys 1-4 open them
        with TabbedContent(id="tabs"):
            with (
                TabPane(titles[0], id="tab-contribution"),
                VerticalScroll(classes="tab-body"),
                Grid(id="contribution-panels", classes="panels"),
            ):
                # Most wanted first: at 80x24 the first row is what shows without scrolling.
                yield JoinPanel(id="join", classes="panel")
                yield PointsPanel(tz=self.tz, id="points", classes="panel")
                yield TrainingPanel(tz=self.tz, id="training", classes="panel")
                yield SpartaPanel(tz=self.tz, id="sparta", classes="panel")
                yield SharePanel(tz=self.tz, id="share", classes="panel")
                yield GpuPanel(id="gpu", classes="panel")
                yield IdentityPanel(id="identity", classes="panel")
            with TabPane(titles[1], id="tab-swarm"), VerticalScroll(classes="tab-body"):
                yield StagesPanel(id="stages", classes="panel")  # as tall as the run has stages
                with Grid(classes="panels"):
                    yield LossPanel(tz=self.tz, id="loss", classes="panel")
                    yield TokensPanel(tz=self.tz, id="tokens", classes="panel")
            with TabPane(titles[2], id="tab-network"), VerticalScroll(classes="tab-body"), Grid(classes="panels"):
                yield NetworkPanel(tz=self.tz, id="network", classes="panel")
                yield ConnectionPanel(id="connection", classes="panel")
            yield TabPane(titles[3], id=LOG_TAB)  # empty: the app's log pane fills it (app.tcss, -log-tab)

    @property
    def active(self) -> str:
        return self.query_one(TabbedContent).active

    @active.setter
    def active(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    def show(self, event: Event) -> None:
        """Hand ``event`` to the panels it feeds (kinds no panel shows are ignored)."""
        match event:
            case AuthEvent():
                self.query_one(IdentityPanel).show_auth(event)
            case StageEvent():
                self.query_one(IdentityPanel).show_stage(event)
                self.query_one(SharePanel).show_stage(event)
            case DownloadEvent() | QueueEvent() | SyncEvent():
                self.query_one(JoinPanel).show(event)
            case StepEvent():
                self.query_one(TrainingPanel).show(event)
                share = self.query_one(SharePanel)
                share.show(event)
                self.query_one(StagesPanel).show_share(share.share)
                self.query_one(JoinPanel).follow_epoch(event)
            case TrafficEvent():
                self.query_one(TrainingPanel).show_traffic(event)
                self.query_one(NetworkPanel).show(event)
            case SwarmEvent():
                self.query_one(LossPanel).show(event)
                self.query_one(TokensPanel).show(event)
                self.query_one(StagesPanel).show(event)
            case SpartaEvent():
                sparta = self.query_one(SpartaPanel)
                sparta.show(event)
                self.query_one(StagesPanel).show_sparta(sparta.tally)
            case ResourcesEvent():
                self.query_one(GpuPanel).show(event)
            case YieldEvent():
                self.query_one(GpuPanel).show_yield(event)
            case EnergyEvent():
                self.query_one(PointsPanel).show_energy(event)
            case PointsEvent():
                self.query_one(PointsPanel).show(event)
            case ReachabilityEvent():
                self.query_one(ConnectionPanel).reachability = event
