"""Where the executors are: `--executor` addresses, parsed and resolved.

An address is either `host:port` (one executor; gRPC resolves the host itself, as it always did) or
`dns:///name:port`, gRPC's own spelling for "every address this name resolves to". The second form
is what makes `docker compose up --scale executor=N` and a Kubernetes headless Service work: the
name resolves to one A/AAAA record per replica, and each record is one executor. The engine
re-resolves such names every `--executor-refresh-interval` seconds; this module only parses and
resolves (no asyncio, no state), so it is tested with a patched `getaddrinfo`.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DNS_SCHEME = "dns:"


@dataclass(frozen=True)
class ExecutorTarget:
    """One `--executor` value. `dns` targets stand for every address `host` resolves to."""

    text: str
    host: str
    port: int
    dns: bool


def _split_host_port(text: str, hostport: str) -> tuple[str, int]:
    if hostport.startswith("["):  # [v6]:port
        host, sep, rest = hostport[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"executor address {text!r}: expected [IPV6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = hostport.rpartition(":")
        if not sep:
            raise ValueError(f"executor address {text!r} has no PORT: expected HOST:PORT or dns:///NAME:PORT")
        if ":" in host:
            raise ValueError(f"executor address {text!r}: write an IPv6 address as [ADDR]:PORT")
    if not host:
        raise ValueError(f"executor address {text!r} has no HOST")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"executor address {text!r}: its PORT must be in 1..65535, got {port_text!r}")
    return host, int(port_text)


def parse_executor_target(text: str) -> ExecutorTarget:
    """Parses one `--executor` value.

    Raises:
        ValueError: a malformed address (the message names it and what is wrong).
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"executor address must be a non-empty string, got {text!r}")
    if text.startswith(DNS_SCHEME):
        rest = text[len(DNS_SCHEME) :]
        if not rest.startswith("///"):
            raise ValueError(
                f"executor address {text!r}: write dns:///NAME:PORT (a DNS server authority, "
                "dns://SERVER/NAME:PORT, is not supported)"
            )
        host, port = _split_host_port(text, rest[3:])
        return ExecutorTarget(text, host, port, dns=True)
    if "://" in text:
        raise ValueError(f"executor address {text!r}: only HOST:PORT and dns:///NAME:PORT are understood")
    host, port = _split_host_port(text, text)
    return ExecutorTarget(text, host, port, dns=False)


def format_address(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets (the form gRPC targets take)."""
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


GetAddrInfo = Callable[..., list]


def resolve(target: ExecutorTarget, getaddrinfo: GetAddrInfo | None = None) -> list[str]:
    """The executor addresses `target` stands for, in resolver order, without duplicates.

    A `host:port` target is itself (one executor, whatever its name resolves to). A `dns:///` target
    is every IPv4 and IPv6 address of its name, one executor each.

    Raises:
        OSError (socket.gaierror): the name does not resolve now.
    """
    if not target.dns:
        return [target.text]
    getaddrinfo = getaddrinfo or socket.getaddrinfo
    infos = getaddrinfo(target.host, target.port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM)
    addresses: dict[str, None] = {}
    for family, _type, _proto, _canonname, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            host = sockaddr[0].split("%", 1)[0]  # drop an IPv6 zone id
            addresses[format_address(host, target.port)] = None
    return list(addresses)


def resolve_all(
    targets: Iterable[ExecutorTarget],
    previous: dict[str, list[str]],
    getaddrinfo: GetAddrInfo | None = None,
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Resolves every target. A name that fails to resolve keeps its previous addresses (a DNS
    hiccup must not drop healthy executors; a dead one is noticed by its own connection).

    Returns:
        (addresses of each target by its text, the error of each target that failed to resolve)
    """
    resolved: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    for target in targets:
        try:
            resolved[target.text] = resolve(target, getaddrinfo)
        except OSError as exc:
            errors[target.text] = str(exc)
            resolved[target.text] = previous.get(target.text, [])
    return resolved, errors
