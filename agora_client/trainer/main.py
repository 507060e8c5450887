"""`agora trainer`: a CPU-only loop that streams its data shard through the remote pipeline.

Output lines (stdout), parseable by tests and the swarm launcher:
  [TRAINER] waiting for workers: ...
  [PROGRESS] microbatches=<n> loss=<mean since last line, n/a if none finished> tokens_per_s=<x>
              | <per-stage roster, bans, served per uid>
  [ROSTER] <stage>: +<uid joined> -<uid gone> (<n> workers)
  [TRAFFIC] {"<stage>.<forward|backward>_<request|reply>": serialized bytes per token, ...}
  [RETRY] <stage> <kind> on <uid> failed after <s>s (<error class>[, banned]): <error>; <what happens next>
  [SPOTCHECK] checks=<n> agreed=<n> resolved=<n> unresolved=<n> bans=<n> (totals, with every progress line)
  [SPOTCHECK] stages {"<stage>": {checks, strikes, bans, forward, backward: standings with their tolerances,
              parameter_drift: the stage's replica drift, null when unknown}, ...} (with every progress line)
  [SPOTCHECK] banned <uid> (peer <peer id>) of <stage>: ...
  [EVAL] loss=<held-out loss> sequences=<n> tokens=<n> (every eval.every_s, forward passes only)
  [RECEIPTS] <what each worker served this trainer is published for the monitor, or off> (once, at the start)
  [DATA] <source, shard, tokenizer, where the data starts>
  [METRICS] <where --metrics-port serves this trainer's Prometheus metrics> (once, with --metrics-port)
  [WARNING] ...
Every [PROGRESS] report is also stored in the DHT (trainer/progress.py): contributors draw the
swarm's loss from it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from agora_client.auth.client import AuthFailed
from agora_client.auth.secret import Secret
from agora_client.auth.ticket_source import SelfIssuedTickets, TicketSource
from agora_client.auth.trainer_tickets import IssuedTrainerTickets
from agora_client.auth.transport import refuse_plain_http
from agora_client.config import ConfigError, RunConfig, load_config
from agora_client.data.heldout import held_out_sample
from agora_client.data.sources import DataError, Shard
from agora_client.data.stream import TokenStream
from agora_client.data.tokenizer import TokenizerError, load_run_tokenizer
from agora_client.discovery.dht import NoSeedAnswered, connect_dht
from agora_client.engine.records import signature_validator
from agora_client.monitor.verdicts import Verdict, publish_verdict, trainer_peer_id
from agora_client.operator_metrics import MetricsEndpoint, add_metrics_arguments, open_metrics_endpoint
from agora_client.snapshots import SnapshotError, open_store
from agora_client.system.lifetime import stop_on_signals
from agora_client.trainer.balancer import RoundRobinBalancer, Router, StageBalancer
from agora_client.trainer.calibration import describe
from agora_client.trainer.escrow import Escrow
from agora_client.trainer.evaluation import HeldOutEvaluation
from agora_client.trainer.loop import TrainingLoop
from agora_client.trainer.operator_metrics import trainer_collector
from agora_client.trainer.pipeline import Pipeline, StallNotice
from agora_client.trainer.progress import ProgressPublisher
from agora_client.trainer.receipts import ReceiptBook, publish_every, publish_receipt
from agora_client.trainer.records import TrainerRecords
from agora_client.trainer.replica_drift import ReplicaDrifts, auth_public_key
from agora_client.trainer.roster_watcher import RosterWatcher
from agora_client.trainer.rpc import StageClient, TrafficCounter
from agora_client.trainer.spotcheck import Finding, SpotChecker

VERDICT_TTL = 1800.0  # the monitor keeps what it saw; this only bounds how long a monitor may be away
RECEIPT_PERIOD_S = 15.0  # workers' claims run ahead of their receipts by about this much
LAST_RECEIPT_S = 10.0  # how long a stopping trainer waits for its last receipt to be stored
BALANCERS = {"least-loaded": StageBalancer, "round-robin": RoundRobinBalancer}


def configure(parser: argparse.ArgumentParser) -> None:
    _add_swarm_arguments(parser)
    _add_data_arguments(parser)
    _add_loop_arguments(parser)
    _add_ticket_arguments(parser)
    parser.add_argument(
        "--routing",
        choices=sorted(BALANCERS),
        default="least-loaded",
        help="how a stage's worker is picked (round-robin is the baseline of bench/routing.py)",
    )
    add_metrics_arguments(parser)


def _add_swarm_arguments(parser: argparse.ArgumentParser) -> None:
    """The swarm to join and the run config it trains."""
    parser.add_argument("--seeds", nargs="+", required=True, help="seed multiaddrs")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the trainer's DHT peers listen on (default: loopback)"
    )
    parser.add_argument("--preset", default="tiny", help="run config preset name or YAML path")


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The text this trainer streams, where it starts, and where its position is saved."""
    parser.add_argument(
        "--data",
        default=None,
        help="local .txt/.jsonl/.parquet file or folder, a hub-like folder, or a hub dataset (default: the run "
        "config's data.source)",
    )
    parser.add_argument("--data-subset", default=None, help="the dataset's config name, e.g. sample-10BT (data.subset)")
    parser.add_argument("--data-split", default=None, help="the split to train on (data.split, default train)")
    parser.add_argument(
        "--text-field", default=None, help="the field that holds the text (data.text_field, default text)"
    )
    parser.add_argument(
        "--checkpoints",
        default=None,
        metavar="STORE",
        help="save this trainer's data position and eval loss here every checkpoint.period_s (a directory or s3://)",
    )
    parser.add_argument(
        "--resume-position",
        type=Path,
        default=None,
        metavar="JSON",
        help="a trainer record from a checkpoint set: continue the data with its next token",
    )
    parser.add_argument("--shard", default="0/1", help="this trainer's shard as INDEX/COUNT (default 0/1)")


def _add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """Microbatches in flight, reporting and roster periods, request timeouts and spot checks."""
    parser.add_argument("--inflight", type=int, default=None, help="microbatches in flight at once (optim.inflight)")
    parser.add_argument("--report-every", type=float, default=60.0, help="seconds between progress lines")
    parser.add_argument("--roster-every", type=float, default=5.0, help="seconds between roster reads")
    parser.add_argument("--ban-seconds", type=float, default=30.0, help="how long an unreachable worker is skipped")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a request is given up")
    parser.add_argument("--max-microbatches", type=int, default=0, help="stop after this many (0 = run until stopped)")
    parser.add_argument(
        "--spot-check-fraction",
        type=float,
        default=None,
        help="share of requests also sent to a second worker (default: the run config's spot_checks.fraction)",
    )
    parser.add_argument(
        "--reference-worker",
        action="append",
        default=None,
        metavar="PEER_ID",
        help="an operator-run worker whose answers spot checks trust as the judge, e.g. on a two-worker stage; "
        "repeatable (default: the run config's spot_checks.reference_workers)",
    )


def _add_ticket_arguments(parser: argparse.ArgumentParser) -> None:
    """How the trainer gets its tickets, and whether it publishes signed receipts."""
    parser.add_argument(
        "--ticket-key",
        type=Path,
        default=None,
        metavar="PEM",
        help="the auth service's signing key, on the auth service's own host only: the trainer signs its own tickets "
        "(for the workers, its verdicts on caught workers and its receipts); elsewhere use --credential-file",
    )
    parser.add_argument(
        "--auth-url", default=None, help="the auth service that issues this trainer's tickets (with --credential-file)"
    )
    parser.add_argument(
        "--credential-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the trainer credential `agora trainer-credential add` printed on the auth host (mode 0600)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a plain http:// --auth-url outside this machine and its private network (the "
        "credential then crosses the network in clear text)",
    )
    parser.add_argument(
        "--receipts",
        choices=("on", "off"),
        default="on",
        help="publish signed receipts of what each worker served, which the monitor checks compute "
        "points against (default on); off only in a private swarm without a monitor or points",
    )


_SAY_LOCK = threading.Lock()


def say(tag: str, message: str) -> None:
    with _SAY_LOCK:  # microbatch threads report too: one whole line at a time
        sys.stdout.write(f"[{tag}] {message}\n")
        sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """Join every stage's DHT, wait for workers, then train until stopped; the exit code."""
    stop = stop_on_signals()
    try:
        inputs = _TrainerInputs.load(args)
        metrics = open_metrics_endpoint(args, "trainer")  # MetricsUnavailable is a ValueError
    except (ConfigError, DataError, TokenizerError, SnapshotError, ValueError) as error:
        say("ERROR", str(error))
        return 2
    stages = list(inputs.config.model.stage_names)
    try:
        dhts = {stage: connect_dht(args.seeds, host=args.host) for stage in stages}  # one DHT peer per stage
    except NoSeedAnswered as error:
        say("ERROR", str(error))
        metrics.close()
        return 1
    traffic = TrafficCounter()
    clients = _stage_clients(args, stages, dhts, traffic, inputs.tickets)
    balancer = BALANCERS[args.routing]
    router = Router(stages, lambda stage: balancer(stage, ban_seconds=args.ban_seconds))
    _wait_for_workers(RosterWatcher(dhts, router, args.roster_every, stop, say, inputs.auth_key), router, stop)
    receipts, receipts_thread = _start_receipts(inputs, dhts[stages[0]], stop, enabled=args.receipts == "on")
    pipeline = _pipeline(inputs, stages, clients, router, dhts, stop, receipts)
    try:
        loop = _training_loop(inputs, pipeline, router, traffic, dhts[stages[0]], args)
        metrics.add(trainer_collector(router, lambda: loop.done, pipeline.spot_checks))
        done = loop.run(inputs.config.optim.inflight, args.max_microbatches, args.report_every)
    except DataError as error:  # a bad record further into the data
        say("ERROR", str(error))
        return 2
    finally:
        _shut_down(stop, receipts_thread, clients, dhts, metrics)
    say("TRAINER", f"stopped after {done} microbatches")
    return 0


def _shut_down(
    stop: threading.Event,
    receipts_thread: threading.Thread | None,
    clients: dict[str, StageClient],
    dhts: dict,
    metrics: MetricsEndpoint,
) -> None:
    """Stop the trainer's threads, let the last receipt be stored, then close the stage clients, DHTs and metrics."""
    stop.set()
    if receipts_thread is not None:
        receipts_thread.join(LAST_RECEIPT_S)
    for client in clients.values():
        client.close()
    for dht in dhts.values():
        dht.shutdown()
    metrics.close()


@dataclass
class _TrainerInputs:
    """What the trainer reads before joining.

    The run config, its tokenizer and data, and the operator's key, if given."""

    config: RunConfig
    stream: TokenStream
    batches: Iterator
    held_out: torch.Tensor
    tickets: TicketSource | None  # self-signed (--ticket-key) or the auth service's (--credential-file)
    auth_key: str | None  # verifies trainers' verdicts and workers' drift records (None: neither is read)

    @classmethod
    def load(cls, args: argparse.Namespace) -> "_TrainerInputs":
        """Raises on a bad preset, tokenizer, shard, data or key.

        ConfigError, DataError, TokenizerError or ValueError."""
        config = load_config(args.preset, _overrides(args))
        shard = _parse_shard(args.shard)
        tokenizer = load_run_tokenizer(config)
        position = _resume_position(args.resume_position)
        stream = TokenStream(
            config.data, config.eval, tokenizer, config.model.seq_len, shard, seed=config.seed, position=position
        )
        batches = stream.batches(config.optim.microbatch_size)
        batches = itertools.chain([next(batches)], batches)  # read the source now: bad --data fails before joining
        say(
            "DATA",
            f"{config.data.source or 'the standard library'} shard {shard}, tokenizer {tokenizer.source} "
            f"({tokenizer.vocab_size:,} tokens), "
            + (
                "from the start"
                if position is None
                else f"resumed at pass {position['pass']}, sequence {position['sequences']}"
            ),
        )
        held_out = held_out_sample(config, tokenizer)
        tickets = _ticket_source(args)
        return cls(config, stream, batches, held_out, tickets, auth_public_key(tickets, args.auth_url, say))


def _overrides(args: argparse.Namespace) -> dict:
    """Run config overrides from the command line: spot checks, microbatches in flight and the data source."""
    checks = {"fraction": args.spot_check_fraction, "reference_workers": args.reference_worker}
    checks = {key: value for key, value in checks.items() if value is not None}
    overrides: dict = {"spot_checks": checks} if checks else {}
    if args.inflight is not None:
        overrides["optim"] = {"inflight": args.inflight}
    data = {"source": args.data, "subset": args.data_subset, "split": args.data_split, "text_field": args.text_field}
    data = {key: value for key, value in data.items() if value is not None}
    if data:
        overrides["data"] = data
    return overrides


def _resume_position(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return record["position"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"--resume-position {path} is not a trainer record ({type(error).__name__}); "
            "take it from a checkpoint store's trainers/ folder"
        ) from None


def _training_loop(
    inputs: _TrainerInputs, pipeline: Pipeline, router: Router, traffic: TrafficCounter, dht, args: argparse.Namespace
) -> TrainingLoop:
    config = inputs.config
    progress = ProgressPublisher(dht, ttl=max(60.0, 3 * args.report_every))
    evaluation = HeldOutEvaluation(
        pipeline,
        inputs.held_out,
        config.optim.microbatch_size,
        config.eval.every_s,
        on_failure=lambda message: say("WARNING", message),
    )
    records = None
    if args.checkpoints:
        records = TrainerRecords(
            open_store(args.checkpoints), config, inputs.stream, lambda message: say("WARNING", message)
        )
    # only the spot-check report shows the drift
    key = inputs.auth_key if config.spot_checks.fraction > 0 else None
    drifts = ReplicaDrifts(dht, config.model.stage_names, key, say)
    return TrainingLoop(pipeline, inputs.batches, router, traffic, progress, evaluation, records, say, drifts.read)


def _stage_clients(
    args: argparse.Namespace,
    stages: list[str],
    dhts: dict,
    traffic: TrafficCounter,
    tickets: TicketSource | None,
) -> dict[str, StageClient]:
    """One client per stage, over that stage's DHT peer."""
    if tickets is None:
        say(
            "WARNING",
            "no --credential-file or --ticket-key: requests carry no ticket, and workers that check "
            "tickets will refuse them",
        )
    return {stage: StageClient(stage, dhts[stage], traffic, args.timeout, tickets) for stage in stages}


def _wait_for_workers(watcher: RosterWatcher, router: Router, stop: threading.Event) -> None:
    """Read the rosters until every stage has a worker (or a stop), then keep them current in the background."""
    watcher.refresh()
    while router.empty_stages() and not stop.is_set():
        say("TRAINER", f"waiting for workers: {', '.join(router.empty_stages())}")
        stop.wait(3)
        watcher.refresh()
    watcher.start()


def _pipeline(
    inputs: _TrainerInputs,
    stages: list[str],
    clients: dict[str, StageClient],
    router: Router,
    dhts: dict,
    stop: threading.Event,
    receipts: ReceiptBook | None,
) -> Pipeline:
    """The pipeline over the stage clients, with spot checks if the run config asks for any."""
    config = inputs.config
    margin = config.spot_checks.margin
    spot_checks = SpotChecker(
        config.spot_checks,
        router,
        clients,
        on_ban=lambda finding: _name_liar(finding, dhts, inputs.tickets),
        on_standing=lambda stage, kind, standing: say("SPOTCHECK", describe(stage, kind, standing, margin)),
        on_strike=lambda strike: say("SPOTCHECK", strike.describe(margin, config.spot_checks.strikes)),
        receipts=receipts,
    )
    return Pipeline(
        stages,
        clients,
        router,
        StallNotice(lambda message: say("WARNING", message)),
        stop=stop,
        on_failure=lambda message: say("RETRY", message),
        spot_checks=spot_checks if config.spot_checks.fraction > 0 else None,
        receipts=receipts,
    )


def _start_receipts(
    inputs: _TrainerInputs,
    dht,
    stop: threading.Event,
    *,
    enabled: bool,
) -> tuple[ReceiptBook | None, threading.Thread | None]:
    """Count what each worker serves and publish it every RECEIPT_PERIOD_S, signed, for the monitor; a receipt
    carries the trainer's ticket, so it needs one."""
    if not enabled:
        say(
            "RECEIPTS",
            "off (--receipts off): this trainer publishes no receipts, and the monitor credits no compute "
            "for the work its workers serve it",
        )
        return None, None
    if inputs.tickets is None:
        say(
            "WARNING",
            "no trainer ticket: this trainer publishes no receipts, and the monitor credits no compute "
            "for the work its workers serve it",
        )
        return None, None
    checks = inputs.config.spot_checks
    book = ReceiptBook(inputs.config.model, Escrow(checks) if checks.fraction > 0 else None)
    validator = signature_validator()  # hivemind's process-wide key: the one the trainer's DHTs sign with
    trainer = trainer_peer_id(validator)

    def publish() -> None:
        if stop.is_set() and book.escrow is not None:
            book.escrow.close()  # the last receipt: what this trainer still holds can no longer be vouched for
        try:
            receipt = book.receipt(trainer, inputs.tickets.ticket_for(trainer))
        except AuthFailed as error:
            say(
                "WARNING",
                f"no trainer ticket for this trainer's receipts ({error}); trying again in {RECEIPT_PERIOD_S:g} s",
            )
            return
        if not publish_receipt(dht, receipt, validator):
            say("WARNING", "no DHT node accepted this trainer's receipts; the monitor keeps the last ones it saw")

    say("RECEIPTS", f"what each worker serves this trainer is published for the monitor every {RECEIPT_PERIOD_S:g} s")
    return book, publish_every(RECEIPT_PERIOD_S, publish, stop)


def _name_liar(finding: Finding, dhts: dict, tickets: TicketSource | None) -> None:
    """Say who was banned; with a trainer ticket, also publish a verdict so the monitor withholds its points."""
    worker = finding.worker
    say(
        "SPOTCHECK",
        f"banned {worker.uid} (peer {worker.peer_id}) of {finding.stage}: its outputs disagreed with "
        f"the stage's majority {finding.disagreements} times in {finding.checks} checks",
    )
    validator = signature_validator()  # hivemind's process-wide key: the one the trainer's DHTs sign with
    trainer = trainer_peer_id(validator)
    try:
        ticket = tickets.ticket_for(trainer) if tickets is not None else None
    except AuthFailed as error:
        say("WARNING", f"no trainer ticket for the verdict on {worker.uid} ({error}); the monitor keeps crediting it")
        return
    if ticket is None:
        say("WARNING", "no trainer ticket: the monitor is not told, so it keeps crediting this worker")
        return
    verdict = Verdict(
        trainer=trainer,
        ticket=ticket,
        peer_id=worker.peer_id,
        uid=worker.uid,
        stage=finding.stage,
        checks=finding.checks,
        disagreements=finding.disagreements,
        ts=time.time(),
    )
    if not any(publish_verdict(dhts[finding.stage], verdict, validator, VERDICT_TTL) for _ in range(3)):
        say("WARNING", f"no DHT node accepted the verdict on {worker.uid}; the monitor keeps crediting it")


def _ticket_source(args: argparse.Namespace) -> TicketSource | None:
    """This trainer's tickets: signed by itself with --ticket-key (on the auth host), or the auth service's in
    exchange for --credential-file; ValueError when the flags do not make one."""
    if args.ticket_key and args.credential_file:
        raise ValueError("give --ticket-key (on the auth host) or --credential-file with --auth-url, not both")
    if args.ticket_key:
        return SelfIssuedTickets.from_file(args.ticket_key, role="trainer", stage="trainer")
    if args.credential_file is None:
        return None
    if not args.auth_url:
        raise ValueError("--credential-file needs --auth-url: the auth service that exchanges it for tickets")
    refuse_plain_http(
        args.auth_url,
        insecure=args.insecure,
        what="the auth service",
        why="the trainer credential would cross the network in clear text",
    )
    try:
        credential = Secret(args.credential_file.read_text().strip())
    except OSError as error:
        raise ValueError(f"cannot read --credential-file {args.credential_file}: {error.strerror}") from None
    if not credential:
        raise ValueError(
            f"--credential-file {args.credential_file} is empty; put the token "
            "`agora trainer-credential add` printed in it"
        )
    return IssuedTrainerTickets(args.auth_url, credential)


def _parse_shard(text: str) -> Shard:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise DataError(
            f"--shard {text!r} is not INDEX/COUNT; pass e.g. --shard 0/2 for the first of two trainers"
        ) from None
    return Shard(index, count)
