"""The operator's deploy file: its validation (each error names the field), the plan of each host's roles (order,
command lines, trainers with a credential file and never the signing key, no secret on a command line), the
systemd units written from the same plan, and the `agora snapshot-server` role (Range, HEAD, ETag)."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest
import yaml

from agora_client.deploy import DeployError, chosen_host, load_spec, plan_roles, prepare_secrets
from agora_client.deploy.units import write_units
from agora_client.swarm.processes import ManagedProcess
from agora_client.swarm.roles import SNAPSHOTS_READY, TRAINER_READY, WORKER_READY

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "example.yaml"


def _spec_dict(tmp_path: Path) -> dict:
    """The shipped example with its directories moved under ``tmp_path``."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["run"]["dir"] = str(tmp_path / "run")
    data["secrets"] = str(tmp_path / "secrets")
    data["stores"] = {"snapshots": str(tmp_path / "snapshots"), "checkpoints": str(tmp_path / "checkpoints")}
    return data


def _write(tmp_path: Path, data: dict, name: str = "deploy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _error(tmp_path: Path, data: dict) -> str:
    with pytest.raises(DeployError) as caught:
        load_spec(_write(tmp_path, data))
    return str(caught.value)


def test_the_shipped_example_is_valid():
    spec = load_spec(EXAMPLE)
    assert list(spec.hosts) == ["operator", "trainers"] and spec.trainer_names() == [
        "operator-trainer0",
        "trainers-trainer0",
    ]
    assert spec.role_url("auth") == "https://agora.example.org:8440"


@pytest.mark.parametrize(
    "change, named",
    [
        (
            lambda d: d["hosts"]["operator"]["roles"]["auth"].update(prot=1),
            "hosts.operator.roles.auth.prot: unknown key",
        ),
        (lambda d: d["hosts"]["operator"]["roles"]["auth"].update(identity="token-file"), "needs token_file"),
        (lambda d: d["hosts"]["operator"].update(address="agora.example.org"), "is not an IPv4 address"),
        (lambda d: d["hosts"]["trainers"]["roles"].update(auth={"port": 1}), "all run auth: a swarm has one"),
        (lambda d: d["hosts"]["trainers"]["roles"].update(workers={}), "host trainers runs workers"),
        (lambda d: d["hosts"]["operator"]["roles"].pop("snapshot_server"), "add a snapshot_server role"),
        (lambda d: d["stores"].update(snapshots="s3://bucket/snapshots"), "remove snapshot_server from operator"),
        (lambda d: d.update(this_host="nowhere"), "this_host 'nowhere' is not one of hosts"),
        (lambda d: d["hosts"]["operator"]["roles"]["seeds"].update(port=70000), "hosts.operator.roles.seeds.port"),
    ],
)
def test_a_wrong_deploy_file_is_refused_naming_what_to_change(tmp_path, change, named):
    data = _spec_dict(tmp_path)
    change(data)
    message = _error(tmp_path, data)
    assert message.startswith("invalid deploy file") and named in message


def test_relative_paths_are_relative_to_the_deploy_file(tmp_path):
    data = _spec_dict(tmp_path)
    data.update(secrets="secrets", run={"config": "run.yaml", "dir": "run"})
    spec = load_spec(_write(tmp_path, data))
    assert spec.secrets == tmp_path.resolve() / "secrets" and spec.run.config == str(tmp_path.resolve() / "run.yaml")
    with pytest.raises(DeployError, match="say which this is with --host"):
        chosen_host(spec, None)


def test_operator_plan_starts_roles_in_order_and_keeps_secrets_off_command_lines(tmp_path):
    data = _spec_dict(tmp_path)
    data["hosts"]["operator"]["metrics"] = {"port": 9400, "listen": "203.0.113.10"}
    spec = load_spec(_write(tmp_path, data))
    store = prepare_secrets(spec, "operator")
    steps = plan_roles(spec, "operator", store)
    assert [[launch.name for launch in step] for step in steps] == [
        ["seed0", "seed1"],
        ["snapshot-server", "auth", "head-0", "body1-0", "body2-0", "tail-0"],
        ["monitor", "operator-trainer0"],
    ]
    launches = {launch.name: launch for step in steps for launch in step}
    seed0, seed1 = launches["seed0"].address, launches["seed1"].address
    assert seed0.startswith("/ip4/203.0.113.10/tcp/31330/p2p/") and seed1.startswith("/ip4/203.0.113.10/tcp/31331/p2p/")
    assert (
        plan_roles(spec, "operator", prepare_secrets(spec, "operator"))[0][0].address == seed0
    )  # the same after a restart
    auth = launches["auth"].args
    assert auth[:2] == ("auth", "--state-dir") and _flag(auth, "--snapshot-url") == "https://agora.example.org:8080"
    assert (
        _flag(auth, "--monitor-url") == "https://agora.example.org:8090"
        and _flag(auth, "--tls-cert") == "/etc/agora/tls/fullchain.pem"
    )
    assert [auth[i + 1] for i, arg in enumerate(auth) if arg == "--seed"] == [seed0, seed1]
    trainer = launches["operator-trainer0"]
    assert "--ticket-key" not in trainer.args and trainer.ready == TRAINER_READY
    assert _flag(trainer.args, "--credential-file") == str(store.trainer_credential("operator-trainer0"))
    assert (
        _flag(trainer.args, "--auth-url") == "https://agora.example.org:8440"
        and _flag(trainer.args, "--shard") == "0/2"
    )
    head = launches["head-0"]
    assert head.ready == WORKER_READY and _flag(head.args, "--ticket-key") == str(store.signing_key)
    assert _flag(head.args, "--publish-snapshots") == str(tmp_path / "snapshots")
    assert launches["snapshot-server"].ready == SNAPSHOTS_READY
    _assert_no_secret_on(steps, store)
    # Prometheus: the roles without an HTTP port of their own take the metrics ports in start order
    served = {
        name: (_flag(launch.args, "--metrics-port"), _flag(launch.args, "--metrics-host"))
        for name, launch in launches.items()
        if "--metrics-port" in launch.args
    }
    assert served == {
        name: (str(port), "203.0.113.10")
        for port, name in enumerate(
            ["seed0", "seed1", "head-0", "body1-0", "body2-0", "tail-0", "operator-trainer0"], start=9400
        )
    }


def _flag(args: tuple[str, ...], flag: str) -> str:
    return args[args.index(flag) + 1]


def _secret_values(store) -> list[str]:
    """The signing key's base64 body and each trainer credential's token (files of mode 0600)."""
    files = [store.signing_key, *store.root.glob("trainers/*.credential")]
    assert len(files) == 3 and all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in files)
    key_body = "".join(line for line in store.signing_key.read_text().splitlines() if not line.startswith("-----"))
    return [key_body, *(path.read_text().strip() for path in files[1:])]


def _assert_no_secret_on(steps, store) -> None:
    values = _secret_values(store)
    assert all(len(value) > 30 for value in values)
    command_lines = [" ".join(launch.args) for step in steps for launch in step]
    assert not any(value in line for value in values for line in command_lines)


def test_a_trainer_host_needs_its_credential_and_the_seeds(tmp_path):
    data = _spec_dict(tmp_path)
    spec = load_spec(_write(tmp_path, data))
    with pytest.raises(DeployError, match="trainer trainers-trainer0 has no credential"):
        prepare_secrets(spec, "trainers")
    operator_store = prepare_secrets(spec, "operator")  # the auth host makes every trainer's credential
    seeds = [launch.address for launch in plan_roles(spec, "operator", operator_store)[0]]
    with pytest.raises(DeployError, match="host trainers needs the seeds' multiaddrs"):
        plan_roles(spec, "trainers", prepare_secrets(spec, "trainers"))
    data["seeds"] = seeds
    spec = load_spec(_write(tmp_path, data))
    [[trainer]] = plan_roles(spec, "trainers", prepare_secrets(spec, "trainers"))
    assert trainer.name == "trainers-trainer0" and _flag(trainer.args, "--shard") == "1/2"
    assert _flag(trainer.args, "--host") == "203.0.113.11" and trainer.args.count("--seeds") == 1
    assert seeds[0] in trainer.args


def test_units_run_the_plan_in_order_without_secrets(tmp_path):
    spec = load_spec(_write(tmp_path, _spec_dict(tmp_path)))
    store = prepare_secrets(spec, "operator")
    steps = plan_roles(spec, "operator", store)
    paths = write_units(
        steps,
        tmp_path / "units",
        python="/usr/bin/python3",
        checkout=Path("/opt/agora"),
        secrets=store.root,
        user="agora",
    )
    names = [path.name for path in paths]
    assert names[0] == "agora-seed0.service" and names[-1] == "agora.target" and len(names) == 11
    auth = (tmp_path / "units" / "agora-auth.service").read_text()
    assert "ExecStart=/usr/bin/python3 /opt/agora/agora_cli.py auth --state-dir" in auth
    assert "After=network-online.target agora-seed0.service agora-seed1.service" in auth and "User=agora" in auth
    trainer = (tmp_path / "units" / "agora-operator-trainer0.service").read_text()
    assert "agora-auth.service" in trainer.split("After=")[1].splitlines()[0]
    assert "agora-auth.service" in (tmp_path / "units" / "agora.target").read_text()
    values = _secret_values(store)
    assert not any(value in path.read_text() for value in values for path in paths)


def test_snapshot_server_role_serves_ranges_head_and_etags(tmp_path):
    store = tmp_path / "snapshots"
    (store / "head").mkdir(parents=True)
    (store / "head" / "latest.json").write_bytes(b"0123456789")
    server = ManagedProcess(
        "snapshot-server", ["snapshot-server", "--dir", str(store), "--port", "0"], tmp_path / "s.log"
    )
    try:
        url = server.wait_for(SNAPSHOTS_READY, 60).split()[-1]
        head = httpx.head(f"{url}/head/latest.json", timeout=10)
        assert (
            head.status_code == 200
            and head.headers["content-length"] == "10"
            and head.headers["accept-ranges"] == "bytes"
        )
        part = httpx.get(f"{url}/head/latest.json", headers={"Range": "bytes=2-4"}, timeout=10)
        assert part.status_code == 206 and part.content == b"234"
        same = httpx.get(f"{url}/head/latest.json", headers={"If-None-Match": head.headers["etag"]}, timeout=10)
        assert same.status_code == 304
        assert httpx.post(f"{url}/head/latest.json", timeout=10).status_code == 405
    finally:
        server.stop(grace=10)
    assert not server.alive and server.group_pids() == []


def test_down_without_up_says_nothing_runs(tmp_path, capsys):
    from agora_client.deploy.stop import down

    spec = load_spec(_write(tmp_path, _spec_dict(tmp_path)))
    assert down(spec, "operator", grace=1.0) == 0
    assert "nothing runs from this deploy file on operator" in capsys.readouterr().out


def test_relay_deploy_gives_the_relay_the_auth_services_public_key(tmp_path):
    from agora_client.auth.tickets import load_signing_key, public_key_text

    data = _spec_dict(tmp_path)
    data["hosts"]["operator"]["roles"]["relay"] = {"port": 47100, "ports": "47000-47099"}
    spec = load_spec(_write(tmp_path, data))
    store = prepare_secrets(spec, "operator")
    [relay] = [launch for step in plan_roles(spec, "operator", store) for launch in step if launch.name == "relay"]
    assert _flag(relay.args, "--auth-public-key") == public_key_text(load_signing_key(store.signing_key))
    store.signing_key.unlink()  # a relay host without the secrets the auth host made
    with pytest.raises(DeployError, match="the relay needs the auth service's key"):
        plan_roles(spec, "operator", store)
