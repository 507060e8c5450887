"""Help: what each panel means and the keys."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# Agora contributor client

Your GPU holds one stage of the model and trains it with the other contributors.

**Preflight** (before authorization, in place of the panels): each check the worker runtime
makes on this machine and its network, ✔ pass, ▲ warn or ✖ fail, with what it measured and why:
GPU, host RAM, free disk for the stage's snapshots, download rate from the swarm's snapshot server,
round trip to the seeds, and reachability (the swarm connects back to your worker's port). A failed
machine check stops the worker: fix what it says, then restart. While the swarm cannot reach the
worker, the diagnosis says which port, tested from where and what to open; the worker tries again
every `--retry-every` seconds (30 by default), or at once on `r`.

**Join path**: Authorization (your Hugging Face token buys a slot and a stage), Download
(the stage's snapshot; an interrupted download resumes), Queue (joins are paced),
Sync 1 (weights catch up, no batches yet), Sync 2 (optimizer warms up on real batches), Active.

**Panels** (charts show the recent history):
the current join step; **Points** (your local estimate: presence from sync 1, compute from
sync 2; the monitor's confirmed total and your rank on its leaderboard); **Swarm loss** (the
loss the trainers report, and their loss on held-out data once they evaluate: is the swarm
learning?); **Requests served** (forward and backward requests per minute, counted as your
node answers them); **Bandwidth** (what your node sends and receives per second, requests
and averaging together); **Share of the stage** (your part of the samples your stage
processed last epoch, against an even split); **SPARTA averaging** (rounds with peers of
your stage: which slice of its parameters each round averaged and its share of the stage); identity and stage; GPU (or worker and host memory without an NVIDIA driver).

| key | action |
| --- | --- |
| `q` / `Ctrl+C` | stop the worker gracefully and quit |
| `e` | export a support bundle (zip, secrets redacted) |
| `l` | show or hide the log pane |
| `r` | restart the worker after it stopped (`--restart on-failure` restarts a crashed one by itself); while the swarm cannot reach it, retry now |
| `p` | show or hide the preflight checks |
| `?` | this help |
| `Ctrl+P` | command palette (theme, export, logs...) |
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Close", id="help.close"),
        Binding("question_mark", "dismiss", "Close", show=False, id="help.close_question"),
        Binding("q", "dismiss", "Close", show=False, id="help.close_q"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Markdown(HELP)
