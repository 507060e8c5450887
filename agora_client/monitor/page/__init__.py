"""The swarm's public page, served by the monitor: HTML shells, a stylesheet and a small vanilla-JS renderer shipped as
files of this package (``static/``), which poll the monitor's JSON API and draw the tables and SVG charts; and the JSON
views the page reads beyond the API's leaderboard and learning curve (``views``)."""

from agora_client.monitor.page.files import CONTENT_SECURITY_POLICY, PageFiles, contributor_name
from agora_client.monitor.page.views import RunInfo, contributor_view, run_info, swarm_view

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "PageFiles",
    "RunInfo",
    "contributor_name",
    "contributor_view",
    "run_info",
    "swarm_view",
]
