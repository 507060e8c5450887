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
        for kinds, feed in self._FEEDS:
            if isinstance(event, kinds):
                feed(self, event)
                return

    def _show_auth(self, event: AuthEvent) -> None:
        self.query_one(IdentityPanel).show_auth(event)

    def _show_stage(self, event: StageEvent) -> None:
        self.query_one(IdentityPanel).show_stage(event)
        self.query_one(SharePanel).show_stage(event)

    def _show_join(self, event: DownloadEvent | QueueEvent | SyncEvent) -> None:
        self.query_one(JoinPanel).show(event)

    def _show_step(self, event: StepEvent) -> None:
        self.query_one(TrainingPanel).show(event)
        share = self.query_one(SharePanel)
        share.show(event)
        self.query_one(StagesPanel).show_share(share.share)
        self.query_one(JoinPanel).follow_epoch(event)

    def _show_traffic(self, event: TrafficEvent) -> None:
        self.query_one(TrainingPanel).show_traffic(event)
        self.query_one(NetworkPanel).show(event)

    def _show_swarm(self, event: SwarmEvent) -> None:
        self.query_one(LossPanel).show(event)
        self.query_one(TokensPanel).show(event)
        self.query_one(StagesPanel).show(event)

    def _show_sparta(self, event: SpartaEvent) -> None:
        sparta = self.query_one(SpartaPanel)
        sparta.show(event)
        self.query_one(StagesPanel).show_sparta(sparta.tally)

    def _show_resources(self, event: ResourcesEvent) -> None:
        self.query_one(GpuPanel).show(event)

    def _show_yield(self, event: YieldEvent) -> None:
        self.query_one(GpuPanel).show_yield(event)

    def _show_energy(self, event: EnergyEvent) -> None:
        self.query_one(PointsPanel).show_energy(event)

    def _show_points(self, event: PointsEvent) -> None:
        self.query_one(PointsPanel).show(event)

    def _show_reachability(self, event: ReachabilityEvent) -> None:
        self.query_one(ConnectionPanel).reachability = event

    # each kind of event and the method that hands it to its panels
    _FEEDS = (
        (AuthEvent, _show_auth),
        (StageEvent, _show_stage),
        ((DownloadEvent, QueueEvent, SyncEvent), _show_join),
        (StepEvent, _show_step),
        (TrafficEvent, _show_traffic),
        (SwarmEvent, _show_swarm),
        (SpartaEvent, _show_sparta),
        (ResourcesEvent, _show_resources),
        (YieldEvent, _show_yield),
        (EnergyEvent, _show_energy),
        (PointsEvent, _show_points),
        (ReachabilityEvent, _show_reachability),
    )
