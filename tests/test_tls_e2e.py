"""TLS on real processes: the scheduler's public port serves TLS (plaintext refused), the executor
requires a client certificate (mTLS) and the scheduler presents one on its channel to it; the
certificates are made at test time (tests/certs.py)."""

from __future__ import annotations

import grpc
import pytest

from pagedserve.client import generate, make_request
from pagedserve.common.tls import ChannelTls, ServerTls, TlsConfigError
from pagedserve.protos import executor_pb2, executor_pb2_grpc, generation_pb2, generation_pb2_grpc
from pagedserve.scheduler.service_config import ServiceConfig
from tests.certs import make_ca, make_cert
from tests.services import running_services, wait_for_idle


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca = make_ca(directory)
    return {
        "ca": ca,
        "server": make_cert(ca, directory, "server"),
        "client": make_cert(ca, directory, "client", usage="clientAuth"),
        "other_ca": make_ca(directory, "other-ca"),
    }


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory, pki):
    ca, server, client = pki["ca"], pki["server"], pki["client"]
    with running_services(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        executor_args=(
            f"--ssl-certfile={server.cert}", f"--ssl-keyfile={server.key}", f"--ssl-ca-certs={ca.cert}",
        ),
        scheduler_args=(
            f"--ssl-certfile={server.cert}", f"--ssl-keyfile={server.key}",
            f"--executor-ssl-ca-certs={ca.cert}",
            f"--executor-ssl-certfile={client.cert}", f"--executor-ssl-keyfile={client.key}",
        ),
        credentials=grpc.ssl_channel_credentials(root_certificates=ca.cert.read_bytes()),
    ) as s:  # fmt: skip
        yield s


def _model_info(channel: grpc.Channel) -> generation_pb2.ModelInfo:
    return generation_pb2_grpc.GenerationStub(channel).GetModelInfo(
        generation_pb2.GetModelInfoRequest(), timeout=10
    )


def _executor_stats(channel: grpc.Channel) -> executor_pb2.ExecutorStats:
    return executor_pb2_grpc.ExecutorStub(channel).GetStats(executor_pb2.GetStatsRequest(), timeout=10)


@pytest.mark.slow
def test_tls_client_with_the_ca_is_served_over_an_mtls_internal_link(services):
    # The scheduler reached the executor (mTLS, its client certificate) and serves over TLS.
    with services.channel() as channel:
        result = generate(channel, make_request([5, 6, 7], max_tokens=5, ignore_eos=True), timeout=60)
    assert len(result.token_ids) == 5
    assert wait_for_idle(services).gpu_blocks_in_use == 0


@pytest.mark.slow
def test_plaintext_is_refused_on_both_ports(services):
    for port, call in ((services.port, _model_info), (services.executor_port, _executor_stats)):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as err:
            call(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_tls_clients_the_servers_do_not_accept(services, pki):
    executor = f"127.0.0.1:{services.executor_port}"
    ca = pki["ca"].cert.read_bytes()
    # mTLS: a client that trusts the executor but has no certificate of its own is refused.
    with grpc.secure_channel(executor, grpc.ssl_channel_credentials(ca)) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _executor_stats(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    client = ChannelTls(str(pki["ca"].cert), str(pki["client"].cert), str(pki["client"].key))
    with grpc.secure_channel(executor, client.credentials()) as channel:
        assert _executor_stats(channel).steps > 0
    # A client trusting another CA does not accept the scheduler's certificate.
    other = grpc.ssl_channel_credentials(pki["other_ca"].cert.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{services.port}", other) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _model_info(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_an_open_internal_link_is_warned_about_once(services):
    # This pair runs without an internal token: each side says so, once, at start.
    assert services.scheduler_log().count("internal link unauthenticated") == 1
    assert services.executor_log().count("internal link unauthenticated") == 1


def test_tls_flags_that_do_not_go_together():
    with pytest.raises(TlsConfigError, match="go together"):
        ServerTls.from_flags("cert.pem", None, None)
    with pytest.raises(TlsConfigError, match="needs --ssl-certfile"):
        ServerTls.from_flags(None, None, "ca.pem")
    with pytest.raises(ValueError, match="go together"):
        ServiceConfig(model="m", executor_ssl_certfile="client.pem")
    config = ServiceConfig(model="m", executor_ssl_ca_certs="ca.pem")
    assert config.executor_channel_tls() == ChannelTls("ca.pem")
    assert ServiceConfig(model="m").executor_channel_tls() is None
    with pytest.raises(TlsConfigError, match="cannot read --ssl-keyfile"):
        ServerTls("absent.pem", "absent.key").credentials()
