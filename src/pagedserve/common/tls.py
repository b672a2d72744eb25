"""TLS credentials from PEM files, for both services' servers and the scheduler's executor channel.

Flag names are vLLM's (`--ssl-certfile`, `--ssl-keyfile`, `--ssl-ca-certs`). A server with a
certificate and key serves TLS only (grpc's secure port refuses plaintext); with CA certificates
as well it requires and verifies a client certificate signed by them (mTLS). The scheduler's
channel to an executor has its own trio (`--executor-ssl-ca-certs`, `--executor-ssl-certfile`,
`--executor-ssl-keyfile`): the roots it trusts for the executor's certificate, and the client
certificate an executor with `--ssl-ca-certs` asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """TLS flags that cannot work together (a certificate without its key, say)."""


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"cannot read {flag} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS files; `ca_certs` switches on client-certificate verification (mTLS)."""

    certfile: str
    keyfile: str
    ca_certs: str | None = None

    @staticmethod
    def from_flags(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> ServerTls | None:
        """The TLS of `--ssl-certfile/--ssl-keyfile/--ssl-ca-certs`, None when TLS is off.

        Raises:
            TlsConfigError: one of certificate and key without the other, or CA certs without both.
        """
        if certfile is None and keyfile is None:
            if ca_certs is not None:
                raise TlsConfigError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile (TLS)")
            return None
        if certfile is None or keyfile is None:
            raise TlsConfigError("--ssl-certfile and --ssl-keyfile go together")
        return ServerTls(certfile, keyfile, ca_certs)

    def credentials(self) -> grpc.ServerCredentials:
        """grpc's server credentials, the files read now (a missing file is a TlsConfigError)."""
        pair = (_read(self.keyfile, "--ssl-keyfile"), _read(self.certfile, "--ssl-certfile"))
        roots = None if self.ca_certs is None else _read(self.ca_certs, "--ssl-ca-certs")
        return grpc.ssl_server_credentials(
            [pair], root_certificates=roots, require_client_auth=roots is not None
        )


@dataclass(frozen=True)
class ChannelTls:
    """A client's TLS files: the roots that sign the server's certificate (None: the system's)
    and, for a server that requires one, a client certificate and key."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    flag_prefix: str = "--executor-ssl"  # how the error messages name the files

    def __post_init__(self) -> None:
        if (self.certfile is None) != (self.keyfile is None):
            raise TlsConfigError(f"{self.flag_prefix}-certfile and {self.flag_prefix}-keyfile go together")

    def credentials(self) -> grpc.ChannelCredentials:
        roots = None if self.ca_certs is None else _read(self.ca_certs, f"{self.flag_prefix}-ca-certs")
        key = None if self.keyfile is None else _read(self.keyfile, f"{self.flag_prefix}-keyfile")
        chain = None if self.certfile is None else _read(self.certfile, f"{self.flag_prefix}-certfile")
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)
