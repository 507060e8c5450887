"""The app as a front end: runs a prepared client session (agora_client.frontend.client) in Textual."""

from __future__ import annotations

from pathlib import Path

from agora_client.frontend.client import ClientSession
from tui.app import AgoraApp, BundleTarget


def run_app(session: ClientSession) -> int:
    bundle = BundleTarget(session.config_dir, session.logs_dir, Path.cwd(), session.secrets)
    app = AgoraApp(
        session.command,
        event_log=session.event_log(),
        bundle=bundle,
        restart=session.restart_policy(),
        notify_cmd=session.notify_cmd,
        secrets=session.secrets,
        pause_control=session.toggle_pause,
    )
    try:
        app.run()
    finally:
        if app.process is not None and app.process.running:  # the terminal went away mid-run
            app.process.kill()
    return app.return_code or 0
