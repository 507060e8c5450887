"""The app's widgets, one per file."""

from tui.widgets.connection import ConnectionPanel
from tui.widgets.dashboard import Dashboard
from tui.widgets.download import DownloadPanel
from tui.widgets.gpu import GpuPanel
from tui.widgets.identity import IdentityPanel
from tui.widgets.join_panel import JoinPanel
from tui.widgets.log_pane import LogPane
from tui.widgets.loss import LossPanel
from tui.widgets.network import NetworkPanel
from tui.widgets.points import PointsPanel
from tui.widgets.preflight import PreflightPanel
from tui.widgets.queue import QueuePanel
from tui.widgets.reachability import ReachabilityPanel
from tui.widgets.runtime_status import RuntimeStatus
from tui.widgets.share import SharePanel
from tui.widgets.sparta import SpartaPanel
from tui.widgets.stages import StagesPanel
from tui.widgets.status_band import StatusBand
from tui.widgets.stepper import Stepper
from tui.widgets.sync import SyncPanel
from tui.widgets.tokens import TokensPanel
from tui.widgets.training import TrainingPanel

__all__ = [
    "ConnectionPanel",
    "Dashboard",
    "DownloadPanel",
    "GpuPanel",
    "IdentityPanel",
    "JoinPanel",
    "LogPane",
    "LossPanel",
    "NetworkPanel",
    "PointsPanel",
    "PreflightPanel",
    "QueuePanel",
    "ReachabilityPanel",
    "RuntimeStatus",
    "SharePanel",
    "SpartaPanel",
    "StagesPanel",
    "StatusBand",
    "Stepper",
    "SyncPanel",
    "TokensPanel",
    "TrainingPanel",
]
