"""`--executor` addresses: parsing, DNS resolution, and the scheduler's flags that carry them."""

from __future__ import annotations

import argparse
import socket

import pytest

from pagedserve.scheduler.discovery import parse_executor_target, resolve, resolve_all
from pagedserve.scheduler.service_config import ServiceConfig


def test_parse_host_port_and_dns_names():
    t = parse_executor_target("executor:50061")
    assert (t.host, t.port, t.dns) == ("executor", 50061, False)
    t = parse_executor_target("dns:///executor.pool.svc:7000")
    assert (t.host, t.port, t.dns) == ("executor.pool.svc", 7000, True)
    t = parse_executor_target("[::1]:5")
    assert (t.host, t.port, t.dns) == ("::1", 5, False)
    assert parse_executor_target("dns:///[fd00::2]:9").host == "fd00::2"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("executor", "has no PORT"),
        ("executor:0", "1..65535"),
        ("executor:http", "1..65535"),
        (":50061", "has no HOST"),
        ("::1:5", "IPv6"),
        ("dns://8.8.8.8/executor:1", "not supported"),
        ("http://executor:1", "only HOST:PORT"),
        ("", "non-empty"),
    ],
)
def test_parse_refuses_bad_addresses(text, message):
    with pytest.raises(ValueError, match=message):
        parse_executor_target(text)


def test_resolve_localhost_gives_each_address_once():
    addresses = resolve(parse_executor_target("dns:///localhost:50061"))
    assert "127.0.0.1:50061" in addresses
    assert len(addresses) == len(set(addresses))
    assert all(a in ("127.0.0.1:50061", "[::1]:50061") for a in addresses)
    assert resolve(parse_executor_target("localhost:50061")) == ["localhost:50061"]  # gRPC resolves it


def fake_getaddrinfo(records: dict[str, list[tuple[int, str]]]):
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host not in records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out = []
        for fam, addr in records[host]:
            sockaddr = (addr, port) if fam == socket.AF_INET else (addr, port, 0, 0)
            out.append((fam, socket.SOCK_STREAM, 6, "", sockaddr))
            out.append((fam, socket.SOCK_STREAM, 6, "", sockaddr))  # one per protocol, as libc does
        return out

    return getaddrinfo


def test_resolve_both_families_deduplicated():
    gai = fake_getaddrinfo(
        {
            "pool": [
                (socket.AF_INET, "10.0.0.2"),
                (socket.AF_INET6, "fd00::1%eth0"),
                (socket.AF_INET, "10.0.0.3"),
            ]
        }
    )
    assert resolve(parse_executor_target("dns:///pool:50061"), gai) == [
        "10.0.0.2:50061",
        "[fd00::1]:50061",
        "10.0.0.3:50061",
    ]


def test_a_name_that_stops_resolving_keeps_its_addresses():
    targets = [parse_executor_target("dns:///pool:1"), parse_executor_target("10.0.0.9:2")]
    gai = fake_getaddrinfo({"pool": [(socket.AF_INET, "10.0.0.2")]})
    resolved, errors = resolve_all(targets, {}, gai)
    assert resolved == {"dns:///pool:1": ["10.0.0.2:1"], "10.0.0.9:2": ["10.0.0.9:2"]}
    assert not errors
    again, errors = resolve_all(targets, resolved, fake_getaddrinfo({}))
    assert again == resolved
    assert "dns:///pool:1" in errors


def parse_flags(*argv: str) -> ServiceConfig:
    parser = argparse.ArgumentParser()
    ServiceConfig.add_cli_args(parser)
    return ServiceConfig.from_args(parser.parse_args(["--model", "m", *argv]), parser=parser)


def test_executor_flag_is_repeatable_with_a_default():
    assert parse_flags().executors == ("127.0.0.1:50061",)
    config = parse_flags(
        "--executor", "a:1", "--executor", "dns:///pool:2", "--max-executors", "3",
        "--executor-refresh-interval", "0.5", "--routing-policy", "round_robin",
    )  # fmt: skip
    assert config.executors == ("a:1", "dns:///pool:2")
    assert (config.max_executors, config.executor_refresh_interval, config.routing_policy) == (
        3,
        0.5,
        "round_robin",
    )
    assert parse_flags().max_executors is None
    assert parse_flags().routing_policy == "prefix"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--executor", "nope"), "has no PORT"),
        (("--executor", "a:1", "--executor", "a:1"), "twice"),
        (("--max-executors", "0"), "--max-executors must be positive"),
        (("--executor-refresh-interval", "0"), "--executor-refresh-interval must be positive"),
    ],
)
def test_bad_executor_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_flags(*argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_is_validated_and_frozen():
    with pytest.raises(ValueError, match="non-empty tuple"):
        ServiceConfig(model="m", executors=())
    with pytest.raises(ValueError, match="non-empty tuple"):
        ServiceConfig(model="m", executors=["a:1"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="routing_policy"):
        ServiceConfig(model="m", routing_policy="random")
    config = ServiceConfig(model="m")
    with pytest.raises(AttributeError):
        config.executors = ("b:2",)  # type: ignore[misc]
