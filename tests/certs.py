"""Throwaway TLS material for tests: a CA and certificates it signs for localhost / 127.0.0.1.

Made with the `openssl` command line (the `cryptography` package is not installed here), EC P-256
keys (fast to generate), valid for one day.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes]:
        """(certificate chain, private key) as grpc's credentials take them."""
        return self.cert.read_bytes(), self.key.read_bytes()


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_ca(directory: Path, name: str = "ca") -> Pem:
    directory.mkdir(parents=True, exist_ok=True)
    ca = Pem(directory / f"{name}.pem", directory / f"{name}.key")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", ca.key, "-out", ca.cert, "-days", "1", "-subj", f"/CN=pagedserve test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return ca


def make_cert(ca: Pem, directory: Path, name: str, usage: str = "serverAuth") -> Pem:
    """A certificate signed by `ca` for DNS:localhost and IP:127.0.0.1; `usage` is the extended
    key usage (serverAuth for a server, clientAuth for an mTLS client)."""
    pem = Pem(directory / f"{name}.pem", directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage={usage}\n"
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", pem.key, "-out", csr, "-subj", f"/CN={name}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
        "-out", pem.cert, "-days", "1", "-extfile", ext,
    )  # fmt: skip
    return pem
