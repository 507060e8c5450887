#!/usr/bin/env python3
"""A dress rehearsal of a real run (issue 48): a small internet on this machine, a swarm across it, a seeded script
of events, and a scorecard.

- the operator's host (a network namespace) runs the seeds, the snapshot server, the relay, the auth service, the
  monitor with its public page and two workers per stage, started by `agora deploy up` from a deploy file written
  for the run, with TLS from a CA made for the run, behind `agora deploy firewall --apply`
  (bench/_rehearsal_operator.py);
- the trainers' host runs two trainers holding tickets from their trainer credentials over HTTPS;
- --homes homes, each behind a home router of its own (a real miniupnpd and an nftables NAT): UPnP on, carrier-grade
  NAT (mapping refused: the relay), one with a public address, NAT-PMP only, then UPnP and NAT-PMP in turn
  (bench/_rehearsal_net.py); each line is shaped with tc tbf at a home's speeds scaled to tiny's boundary bytes
  per token as bench/home_link.py --home-mbit scales them; each home runs the real client,
  `python3 agora_cli.py --headless --log-format json --cpu --swarm https://... --ca-cert ...`
  (bench/_rehearsal_homes.py); two homes more run the runtime with tests/faulty_worker.py: the liar's (--lie) and
  the points cheat's (--rotate-run-id, issue 46's presence cheat);
- the run config (bench/_rehearsal_data.py): tiny with its own tokenizer, trained by `agora tokenizer train` on a
  corpus made from this repository's text; the data is tiny's, streamed, one shard per trainer, held-out eval; the
  spot checks raised to a quarter of the requests, so that the liar is caught within the run;
- the script (bench/_rehearsal_script.py), drawn from --seed and printed first: the cheat from the start, a late
  join, the liar's join, a SIGKILL and a rejoin, a pause and a resume (`agora pause` / `agora resume`), a Ctrl-C
  leave, the relay, the auth service, the monitor and a trainer killed, each started again alone by its host's
  `deploy up` (bench/_rehearsal_restarts.py);
- the scorecard (bench/_rehearsal_scorecard.py): per home its path, seconds to its first batch and the join's steps,
  requests served and mission figures; SPARTA rounds ok/total (in and outside the churn windows); training tokens,
  loss and held-out loss; bans (honest ones, and the liar's); points against requests served, and the cheat's;
  slots, queue places, peer bindings and points across the auth crash, points across the monitor's; Prometheus
  scrapes during the run
  (bench/_rehearsal_scrape.py); leftovers (bench/_rehearsal_leftovers.py);
- the public page's leaderboard, read by a headless chromium in a home (it trusts the run's server key), against
  the monitor's (bench/_rehearsal_page.py);
- at the end, the newest checkpoint set exported by `agora export` and loaded by `transformers`, which continues a
  prompt (bench/_rehearsal_export.py);
- after the stop, one process trained on the trainers' very batches to the same token count, its held-out loss and
  its loss at the end against the swarm's (bench/_rehearsal_convergence.py, as bench/convergence.py --tokens does
  for the local swarm).

    python bench/rehearsal.py --homes 3 --minutes 4      # as root, with nft, tc and miniupnpd (miniupnpd-nftables)

Every namespace, rule, qdisc and daemon goes on exit, on failure, Ctrl-C and SIGTERM too. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the namespace helpers live in tests/

import _rehearsal_operator as operator_side  # noqa: E402
from _rehearsal_convergence import convergence_card  # noqa: E402
from _rehearsal_data import run_config  # noqa: E402
from _rehearsal_export import export_card  # noqa: E402
from _rehearsal_homes import Home  # noqa: E402
from _rehearsal_leftovers import RunProcesses, leftovers  # noqa: E402
from _rehearsal_net import ROUTER_KINDS, HomeLink, Internet  # noqa: E402
from _rehearsal_page import page_card  # noqa: E402
from _rehearsal_restarts import Restarts  # noqa: E402
from _rehearsal_scorecard import bans_card, home_card, points_card, sparta_card, training_card  # noqa: E402
from _rehearsal_scrape import Scraper  # noqa: E402
from _rehearsal_script import CHURN_S, Action, draw, play  # noqa: E402
from home_link import bytes_per_token  # noqa: E402

from agora_client.config import load_config  # noqa: E402
from tests.faulty_worker import Faults  # noqa: E402
from tests.netns import unavailable as namespaces_unavailable  # noqa: E402
from tests.netns_router import unavailable as routers_unavailable  # noqa: E402

PRESET, REFERENCE = "tiny", "8b"
DISHONEST = {"liar": Faults(lie=True), "cheat": Faults(rotate_run_id=True)}  # the homes after the honest ones
LIARS = {user for user, faults in DISHONEST.items() if faults.lie}
# (label, uplink, downlink) in Mbit/s at the 8b model's traffic: the homes' lines, in turn
HOME_LINES = (("fibre 100/500", 100.0, 500.0), ("cable 20/200", 20.0, 200.0), ("DSL 10/50", 10.0, 50.0))
POLL_S = 1.0
SAMPLE_EVERY_S = 5.0  # how often the processes of the run's namespaces are listed (for the leftovers)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=40.0, help="how long the swarm runs once the hosts are up")
    parser.add_argument("--homes", type=int, default=6, help="contributors, each behind a router of its own")
    parser.add_argument("--seed", type=int, default=0, help="draws the script of events")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    args = parser.parse_args()
    if not 3 <= args.homes <= 40 or args.minutes <= 0:
        parser.error("use 3 to 40 homes and a positive --minutes")
    return args


def home_links(count: int) -> list[HomeLink]:
    """Each home's line, scaled to tiny's traffic: the same time per token on the link as the 8b model's."""
    scale = bytes_per_token(PRESET)["compressed"] / bytes_per_token(REFERENCE)["compressed"]
    lines = [HOME_LINES[i % len(HOME_LINES)] for i in range(count)]
    return [HomeLink(label, up, down, round(up * scale, 2), round(down * scale, 2)) for label, up, down in lines]


def router_kind(index: int) -> str:
    return ROUTER_KINDS[index] if index < len(ROUTER_KINDS) else ("upnp", "natpmp")[index % 2]


def print_plan(homes: list[Home], actions: list[Action], at_once: set[int], seed: int) -> None:
    for home in homes:
        link = home.link
        print(
            f"{home.user}: router {home.kind}, a {link.label} Mbit/s home line (8b traffic), shaped to "
            f"{link.tiny_up_mbit}/{link.tiny_down_mbit} Mbit/s for {PRESET}'s bytes per token"
        )
    print(f"script (seed {seed}): at t+0 start {', '.join(homes[i].user for i in sorted(at_once))}")
    for action in actions:
        print(action.line(homes))


def run_script(
    homes: list[Home], actions: list[Action], start_home, operator_events: dict, seconds: float, sample
) -> list[tuple[float, float]]:
    """Play the actions on time until ``seconds`` have passed, calling ``sample()`` every ``SAMPLE_EVERY_S``; the
    churn windows, wall-clock: from each event's start to ``CHURN_S`` after it was done (a restart takes a while)."""
    pending, churn, started, sampled = list(actions), [], time.monotonic(), 0.0
    while time.monotonic() < started + seconds:
        if time.monotonic() >= sampled + SAMPLE_EVERY_S:
            sample()
            sampled = time.monotonic()
        while pending and time.monotonic() >= started + pending[0].at_s:
            action, began = pending.pop(0), time.time()
            print(
                f"t+{time.monotonic() - started:5.0f}s {play(action, homes, start_home, operator_events)}",
                flush=True,
            )
            churn.append((began, time.time() + CHURN_S))
        time.sleep(POLL_S)
    return churn


def print_table(card: dict) -> None:
    print(f"{'home':8s}{'router':8s}{'line':15s}{'path':9s}{'1st batch':>10s}{'served':>8s}{'points':>9s}  mission")
    for home in card["homes"]:
        points = card["points"]["per_home"][home["user"]]["score"]
        mission = home["mission"]
        figures = f"auth {bool(mission['authorization'])}, sync {'>'.join(mission['sync_phases']) or '-'}"
        figures += f", sparta {mission['sparta'] or '-'}, points {bool(mission['points'])}"
        print(
            f"{home['user']:8s}{home['router']:8s}{home['link']:15s}{home['path'] or '-':9s}"
            f"{home['first_batch_s'] if home['first_batch_s'] is not None else '-':>10}{home['served']:>8}"
            f"{points if points is not None else '-':>9}  {figures}"
        )
    for home in card["homes"]:
        if steps := home["join_steps"]:
            print(f"{home['user']} join: " + ", ".join(f"{name} {value}" for name, value in steps.items()))
    for name, window in card["sparta"].items():
        print(
            f"SPARTA {name}: ok {window['ok']}/{window['rounds']} ({window['success_rate']}); failures "
            f"{window['failures']}"
        )
    training = card["training"]
    print(
        f"tokens {training['tokens']} at {training['tokens_per_s']} tokens/s over the run "
        f"({training['inflight_total']} microbatches in flight in all); honest bans {card['bans']['honest_bans']}, "
        f"liars banned {card['bans']['liars_banned']} (spot-check share {card['spot_check_share']}); "
        f"points/served rank correlation {card['points']['honest_rank_correlation']} (compute points/FLOPs served "
        f"{card['points']['honest_compute_rank_correlation']}, compute {card['points']['compute_share_of_score']} "
        "of the score); the cheat's points per "
        f"request served over the honest homes' median {card['points']['cheat_ratio']}"
    )
    convergence = card["convergence"]
    print(
        f"loss against one process on the same {convergence['tokens']} tokens (target {convergence['target']}): "
        f"held-out {convergence['held_out']}, at the end {convergence['end']}"
    )
    for restart in card["restarts"]:
        print(f"restart: {restart}")
    export = card["export"]
    if export["ok"]:
        print(
            f"export: the set of {export['set']['at']} (loss {export['set']['loss']}) as {export['model']}: "
            f"{export['text']!r}"
        )
    else:
        print(f"export failed: {export['error']}")
    print(
        f"the public page's leaderboard, in a browser in {card['homes'][0]['user']}, equal to the monitor's: "
        f"{card['page']['same']}"
    )
    print(f"scrapes ok/tried: {card['scrapes']}; leftovers {card['leftovers']}")


def build_homes(net: Internet, users: list[str], root: Path) -> list[Home]:
    """A home per user; the dishonest ones run with their faults."""
    homes = []
    for index, link in enumerate(home_links(len(users))):
        place = net.add_home(index, router_kind(index))
        place.shape(link)
        homes.append(Home(index, users[index], place, link, root / "homes", DISHONEST.get(users[index])))
    return homes


def swarm_run(net, files, homes, at_once, actions, args, processes, scraper) -> tuple[list, list, list, dict, float]:
    """Both operator hosts up, the scrapes begun, the homes started, the script played; (churn windows, leaderboard,
    restarts, the public page against the leaderboard, seconds the script ran)."""
    printed = operator_side.start_operator(files, net.operator)
    operator_side.start_trainers(files, net.trainers, printed)
    print(f"operator and trainers' hosts up; logs in {files.run_dir / 'logs'}", flush=True)
    scraper.start()
    auth_url = operator_side.urls(net.operator)["auth"]

    def start_home(home: Home) -> None:
        home.start(auth_url, files.ca_cert, files.tokens[home.user])

    for index in sorted(at_once):
        start_home(homes[index])
    started = time.monotonic()
    restarts = Restarts(net, files, liars=LIARS)
    churn = run_script(
        homes, actions, start_home, restarts.events(), args.minutes * 60, lambda: processes.sample(net.namespaces())
    )
    board = operator_side.leaderboard(files, net.operator)
    if board is None:
        print("the monitor's leaderboard did not answer at the end: points are left out", flush=True)
    visitor = homes[0].net.home
    page = page_card(
        visitor,
        operator_side.urls(net.operator)["monitor"],
        files.server_cert,
        lambda: operator_side.leaderboard(files, net.operator, reader=visitor),
    )
    return churn, board or [], restarts.records, page, time.monotonic() - started


def rehearse(args: argparse.Namespace, root: Path) -> dict:
    users = [*(f"home{i}" for i in range(args.homes)), *DISHONEST]  # draw() takes the liar, then the cheat
    at_once, actions = draw(args.seed, args.homes, args.minutes * 60)
    config_path, data = run_config(root / "data", PRESET)
    config = load_config(str(config_path))
    print(
        f"run config {config_path}: {PRESET} with its own tokenizer, trained by `agora tokenizer train` on "
        f"{data['corpus_documents']} documents of this repository (sha256 {data['sha256'][:12]}...)",
        flush=True,
    )
    with Internet(f"agr-{os.getpid()}") as net:
        homes = build_homes(net, users, root)
        print_plan(homes, actions, at_once, args.seed)
        files = operator_side.prepare(root / "operator", net.operator, net.trainers, str(config_path), users)
        endpoints = operator_side.metrics_endpoints(net.operator, net.trainers, config.model.stage_names)
        scraper, processes = Scraper(endpoints, files.ca_cert), RunProcesses()
        try:
            churn, board, restarts, page, seconds = swarm_run(
                net, files, homes, at_once, actions, args, processes, scraper
            )
        finally:
            processes.sample(net.namespaces())
            scrapes = scraper.stop()
            for home in homes:
                home.stop()
            print(operator_side.stop_host(files, net.trainers, "trainers"), flush=True)
            print(operator_side.stop_host(files, net.operator, "operator"), flush=True)
            left_running = sum(len(host.pids()) for host in (net.operator, net.trainers, *(h.net.home for h in homes)))
        cards = [home_card(home, config) for home in homes]
        tokens_per_microbatch = config.optim.microbatch_size * config.model.seq_len
        card = {
            "bench": "rehearsal",
            "seed": args.seed,
            "minutes": args.minutes,
            "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "data": data,
            "spot_check_share": config.spot_checks.fraction,
            "homes": cards,
            "sparta": sparta_card(homes, files.run_dir, churn),
            "training": training_card(files.run_dir / "logs", tokens_per_microbatch, config.optim.inflight, seconds),
            "bans": bans_card(files.run_dir / "logs", cards, liars=LIARS),
            "points": points_card(cards, board, dishonest=set(DISHONEST), cheat="cheat"),
            "restarts": restarts,
            "page": page,
            "scrapes": scrapes,
            "running_after_stop": left_running,
            "export": export_card(files.checkpoints, root / "export"),
            "convergence": convergence_card(config, files.run_dir / "logs"),
        }
    card["leftovers"] = leftovers(net.namespaces(), processes, root)
    return card


def main() -> int:
    args = parse_args()
    if reason := routers_unavailable() or namespaces_unavailable(shaping=True):
        raise SystemExit(f"the rehearsal's hosts, routers and shaped lines need: {reason}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up like Ctrl-C
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-rehearsal-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"run directory {root}", flush=True)
    card = rehearse(args, root)
    print_table(card)
    print(json.dumps(card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
