"""`agora deploy firewall`: the nftables ruleset names exactly the host's HTTP ports, the per-address limits and the
trusted proxies; and in a network namespace of the test's own, the kernel drops the SYNs of one address beyond its
burst while other addresses and exempt ones still connect, until the table is removed."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from agora_client.deploy import cli
from agora_client.deploy.firewall import FirewallError, apply_ruleset, remove_ruleset, render_ruleset
from agora_client.http_service.limits import ServiceLimits
from tests.netns import Host, unavailable

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "example.yaml"
CONNECT_TIMEOUT_S = 0.5  # a dropped SYN is retried after 1 s: a connect that has not succeeded by then was dropped


def _deploy_file(tmp_path: Path, trusted_proxies: list[str]) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(
        secrets=str(tmp_path / "secrets"),
        run={"config": "tiny", "dir": str(tmp_path / "run")},
        stores={"snapshots": str(tmp_path / "snapshots")},
    )
    operator = data["hosts"]["operator"]
    operator["trusted_proxies"] = trusted_proxies
    operator["roles"]["monitor"]["port"] = 8091  # not a default: the port must come from the file
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _firewall(path: Path, host: str, capsys, *flags: str) -> tuple[int, str, str]:
    """`agora deploy firewall PATH --host HOST FLAGS`: its exit code, stdout and stderr."""
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    code = cli.run(parser.parse_args(["firewall", str(path), "--host", host, *flags]))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_ruleset_names_the_hosts_http_ports_the_limits_and_its_trusted_proxies(tmp_path, capsys):
    code, script, _ = _firewall(
        _deploy_file(tmp_path, ["127.0.0.1", "10.1.0.0/16", "2001:db8::/48"]), "operator", capsys
    )
    assert code == 0
    lines = [line.strip() for line in script.splitlines()]
    assert lines[:3] == ["table inet agora_guard", "delete table inet agora_guard", "table inet agora_guard {"]
    rules = [line for line in lines if line.startswith("tcp dport")]
    port_sets = [set(re.match(r"tcp dport \{ ([^}]*) \}", rule).group(1).split(", ")) for rule in rules]
    assert port_sets == [{"8080", "8440", "8091"}] * 8  # snapshot server, auth, monitor; not seeds, relay, metrics
    limit = f"limit rate over 3000/minute burst {ServiceLimits().max_connections_per_address} packets"
    assert rules[0].endswith("ip saddr { 127.0.0.1/32, 10.1.0.0/16 } accept")
    assert rules[1].endswith("ip6 saddr { 2001:db8::/48 } accept")
    assert rules[2].endswith(f"ct state new add @per_address_v4 {{ ip saddr {limit} }} counter drop")
    assert rules[3].endswith(
        f"ip saddr != @per_address_v4 add @per_block_v4 {{ ip saddr & 255.255.0.0 {limit} }} counter drop"
    )
    assert rules[5].endswith(f"add @per_network_v6 {{ ip6 saddr & ffff:ffff:ffff:ffff:: {limit} }} counter drop")
    assert rules[6].endswith(f"add @per_block_v6 {{ ip6 saddr & ffff:ffff:ffff:: {limit} }} counter drop")
    assert "size 65535;" in script


def test_the_operator_may_size_the_tracked_sets(tmp_path, capsys):
    _, script, _ = _firewall(_deploy_file(tmp_path, []), "operator", capsys, "--tracked-sources", "1000")
    assert script.count("size 1000;") == 4 and "size 65535" not in script


def test_without_trusted_proxies_nothing_is_exempt(tmp_path, capsys):
    _, script, _ = _firewall(_deploy_file(tmp_path, []), "operator", capsys)
    assert "accept\n" not in script and script.count("limit rate over") == 6


def test_a_host_without_an_http_role_gets_no_ruleset(tmp_path, capsys):
    code, out, _ = _firewall(_deploy_file(tmp_path, []), "trainers", capsys)
    assert code == 0 and "runs no HTTP role" in out and "table" not in out


def test_a_trusted_proxy_that_is_no_address_is_named(tmp_path, capsys):
    code, _, err = _firewall(_deploy_file(tmp_path, ["proxy.example.org"]), "operator", capsys)
    assert code == 2 and "trusted_proxies: exempt source 'proxy.example.org' is not an IP address" in err


def test_missing_nft_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nft on it
    with pytest.raises(FirewallError, match="apt-get install nftables"):
        apply_ruleset(render_ruleset([8080]))


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) is not installed: apt-get install nftables")
def test_a_caller_other_than_root_is_told_to_use_sudo(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(FirewallError, match="needs root: run this again with sudo"):
        remove_ruleset()


# -- the kernel drops what is over the limit ---------------------------------------------------------------

BURST = 4


@pytest.fixture
def namespace():
    """A network namespace of this test's own with ``lo`` up; deleted afterwards, also when the test fails."""
    if (reason := unavailable(firewall=True)) is not None:
        pytest.skip(reason)
    host = Host(f"agfw-{os.getpid()}", "127.0.0.1", "lo")
    try:
        subprocess.run(["ip", "netns", "add", host.namespace], check=True, capture_output=True, timeout=30)
        host.run("ip", "link", "set", "lo", "up")
        yield host
    finally:
        host.remove()


def _connect(host: Host, port: int, source: str) -> socket.socket | None:
    """A connection from ``source`` to the listener, or None when the SYN went unanswered."""
    with host.entered():
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S, source_address=(source, 0))
        except TimeoutError:
            return None


def test_the_kernel_drops_an_address_beyond_its_burst_until_the_table_is_removed(namespace):
    with namespace.entered():
        listener = socket.create_server(("127.0.0.1", 0), backlog=256)  # never accepts: the kernel completes handshakes
    held: list[socket.socket | None] = []
    try:
        port = listener.getsockname()[1]
        with namespace.entered():
            apply_ruleset(render_ruleset([port], per_minute=1, burst=BURST, exempt=["127.0.0.4"]))
        held += [_connect(namespace, port, "127.0.0.2") for _ in range(BURST + 2)]
        assert [connection is not None for connection in held] == [True] * BURST + [False] * 2
        held += [_connect(namespace, port, "127.0.0.3")]
        assert held[-1] is not None, "another address must still connect"
        held += [_connect(namespace, port, "127.0.0.4") for _ in range(BURST + 2)]
        assert all(connection is not None for connection in held[-(BURST + 2) :]), (
            "an exempt address must not be limited"
        )
        with namespace.entered():
            remove_ruleset()
            remove_ruleset()  # a second time: nothing to remove, no error
        held += [_connect(namespace, port, "127.0.0.2")]
        assert held[-1] is not None, "without the table the limited address connects again"
    finally:
        for connection in held:
            if connection is not None:
                connection.close()
        listener.close()


def test_gaming_a_full_table_limits_new_addresses_per_block_not_unlimited(namespace):
    """Once the per-address set is full, a new address is limited under its /16 (all of 127.0.0.0/16 shares one
    burst) instead of passing unlimited; another /16 still connects, and so does one that finds both sets full."""
    with namespace.entered():
        listener = socket.create_server(("127.0.0.1", 0), backlog=256)
    held: list[socket.socket | None] = []
    try:
        port = listener.getsockname()[1]
        with namespace.entered():
            apply_ruleset(render_ruleset([port], per_minute=1, burst=BURST, tracked=2))
        held += [_connect(namespace, port, source) for source in ("127.0.0.2", "127.0.0.3")]  # the set is full
        newcomers = [f"127.0.1.{last}" for last in range(1, BURST + 3)]  # each connects once, all in one /16
        held += [_connect(namespace, port, source) for source in newcomers]
        assert [connection is not None for connection in held] == [True] * (2 + BURST) + [False] * 2, (
            "new addresses in a full table must share their /16's burst"
        )
        held += [_connect(namespace, port, "127.1.0.1")]
        assert held[-1] is not None, "a new address in another /16 must still connect"
        held += [_connect(namespace, port, "127.2.0.1")]
        assert held[-1] is not None, "one that finds both sets full is limited, not shut out"
        held += [_connect(namespace, port, "127.0.0.2") for _ in range(BURST - 1)]
        assert all(connection is not None for connection in held[-(BURST - 1) :]), (
            "a tracked address keeps its own limit"
        )
    finally:
        for connection in held:
            if connection is not None:
                connection.close()
        listener.close()
        with namespace.entered():
            remove_ruleset()
