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

**Status band** (under the join steps, in every tab): authorization, download, queue position and
estimated wait, sync phase, GPU memory, SPARTA rounds ok of all rounds, points, the swarm's loss.

**Tabs** (keys `1`-`4`; charts draw the recent history against the clock, current values above):
**Contribution**: the current join step; **Points** (your local estimate: presence from sync 1, compute from
sync 2; the monitor's confirmed total and your rank on its leaderboard); **Requests served** (forward and
backward requests per minute, counted as your node answers them); **SPARTA averaging** (rounds with peers
of your stage: which slice of its parameters each round averaged and its share of the stage, and the group
of each round); **Share of the stage** (your part of the samples your stage processed, against an even
split); GPU (or worker and host memory without an NVIDIA driver); identity and stage.
**Swarm**: each stage's workers (active, syncing), its join queue and slots, the trainers' spot checks on
it; the swarm's tokens/s; your share, your stage's SPARTA health and spot-check standing; the loss the
trainers report and their loss on held-out data (is the swarm learning?), and the swarm's tokens/s.
**Network**: what your node sends and receives per second, and how the swarm reaches it.
**Log**: the tagged lines, as headless mode prints them.

| key | action |
| --- | --- |
| `q` / `Ctrl+C` | stop the worker gracefully and quit |
| `e` | export a support bundle (zip, secrets redacted) |
| `1`-`4` | Contribution, Swarm, Network, Log |
| `l` | show or hide the log pane (below 30 rows: open or close the Log tab) |
| `r` | restart the worker after it stopped (`--restart on-failure` restarts a crashed one by itself); while the swarm cannot reach it, retry now |
| `p` | show or hide the preflight checks |
| space | pause contributing, or resume (as `agora pause` / `agora resume`) |
| `?` | this help |
| `Ctrl+P` | command palette (theme, export, logs...) |
"""  # noqa: E501 - a Markdown table row cannot be wrapped


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Close", id="help.close"),
        Binding("question_mark", "dismiss", "Close", show=False, id="help.close_question"),
        Binding("q", "dismiss", "Close", show=False, id="help.close_q"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Markdown(HELP)
