"""The /metrics HTTP endpoint both services serve on `--metrics-port` (prometheus_client's own
server, on a thread of its own)."""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client
from prometheus_client.registry import CollectorRegistry


def metrics_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> Callable[[], None]:
    """Serves `registry` over HTTP at host:port (any path answers, /metrics included); returns the
    function that stops the server. A port in use is an OSError naming the flag to change."""
    try:
        server, thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(
            f"cannot serve metrics on {metrics_address(host, port)} ({exc}); is --metrics-port in use?"
        ) from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop
