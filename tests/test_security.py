"""Token auth, TLS, health and reflection against real servers on 127.0.0.1, port 0.

Each server is started as `rollout-recorder serve` starts it (`start_server`), with a real
token file and real PEM files.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import ipaddress
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from recorder_client._credentials import TOKEN_ENV, TOKEN_FILE_ENV, make_channel
from recorder_client._proto import recorder_pb2 as pb
from recorder_client._proto import recorder_pb2_grpc as pb_grpc
from recorder_client.errors import (
    AuthenticationError,
    NoDataError,
    RecorderUnavailableError,
    from_rpc_error,
)
from recorder_server import RunningServer, ServerOptions, start_server
from recorder_server.cli import health as health_cli
from recorder_server.durability import DurabilityOptions
from recorder_server.rpc.security import (
    MISSING_TOKEN,
    RECORDER_SERVICE_NAME,
    WRONG_TOKEN,
    load_token,
    server_credentials,
)
from recorder_server.sessions import ServiceLimits

TOKEN = "s3cret-T0ken_for.tests"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)


# -- servers -------------------------------------------------------------------
def start_secured(
    *,
    token: str | None = TOKEN,
    tls: tuple[Path, Path] | None = None,
    client_ca: Path | None = None,
    limits: ServiceLimits | None = None,
    serving: bool = True,
) -> RunningServer:
    """A server on 127.0.0.1, port 0, with a token file and optionally TLS (cert, key)."""
    root = Path(tempfile.mkdtemp(prefix="rr-sec-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # after the server stopped
    token_file = None
    if token is not None:
        token_file = root / "token"
        token_file.write_text(token + "\n")
    running = start_server(
        ServerOptions(
            listen="127.0.0.1:0",
            data_dir=str(root / "data"),
            token_file=None if token_file is None else str(token_file),
            tls_cert=None if tls is None else str(tls[0]),
            tls_key=None if tls is None else str(tls[1]),
            tls_client_ca=None if client_ca is None else str(client_ca),
            limits=limits or ServiceLimits(),
            durability=DurabilityOptions(enabled=False),
        )
    )
    if not serving:
        running.set_serving(False)
    return running


@pytest.fixture
def secured() -> Iterator[RunningServer]:
    running = start_secured()
    yield running
    running.stop()


def join(channel: grpc.Channel, session: str = "sec", worker: str = "w0", **kw) -> pb.JoinReply:
    return pb_grpc.RecorderStub(channel).Join(
        pb.JoinRequest(session=session, config=pb.SessionConfig(), worker_id=worker),
        timeout=10,
        **kw,
    )


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, bytes | str):
            list(result)
    return info.value


# -- certificates ----------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert(subject, issuer, public_key, signer, *, ca: bool, extensions=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    for ext in extensions:
        builder = builder.add_extension(ext, critical=False)
    return builder.sign(signer, hashes.SHA256())


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    stranger_cert: Path
    stranger_key: Path


def _make_ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    return key, _cert(_name(cn), _name(cn), key.public_key(), key, ca=True)


def _make_leaf(ca_key, ca_cert, cn: str, *, server: bool) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    extensions = [x509.ExtendedKeyUsage([usage])]
    if server:
        extensions.append(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            )
        )
    cert = _cert(
        _name(cn), ca_cert.subject, key.public_key(), ca_key, ca=False, extensions=extensions
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _make_ca("recorder test CA")
    other_key, other_cert = _make_ca("some other CA")
    files: dict[str, bytes] = {
        "ca.pem": ca_cert.public_bytes(serialization.Encoding.PEM),
        "other_ca.pem": other_cert.public_bytes(serialization.Encoding.PEM),
    }
    files["server.pem"], files["server.key"] = _make_leaf(ca_key, ca_cert, "recorder", server=True)
    files["client.pem"], files["client.key"] = _make_leaf(ca_key, ca_cert, "trainer", server=False)
    files["stranger.pem"], files["stranger.key"] = _make_leaf(
        other_key, other_cert, "stranger", server=False
    )
    for name, data in files.items():
        (root / name).write_bytes(data)
    return Pki(
        ca=root / "ca.pem",
        server_cert=root / "server.pem",
        server_key=root / "server.key",
        client_cert=root / "client.pem",
        client_key=root / "client.key",
        other_ca=root / "other_ca.pem",
        stranger_cert=root / "stranger.pem",
        stranger_key=root / "stranger.key",
    )


# -- token -------------------------------------------------------------------------
def test_no_token_is_unauthenticated(secured):
    with make_channel(secured.address) as channel:
        err = rpc_error(join, channel)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.details() == MISSING_TOKEN
    assert isinstance(from_rpc_error(err), AuthenticationError)


def test_wrong_token_is_unauthenticated(secured):
    with make_channel(secured.address, token="not-" + TOKEN) as channel:
        err = rpc_error(join, channel)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.details() == WRONG_TOKEN
    assert "authentication failed" in str(from_rpc_error(err))


def test_right_token_works(secured):
    with make_channel(secured.address, token=TOKEN) as channel:
        assert join(channel).worker_index == 0
        status = pb_grpc.RecorderStub(channel).GetStatus(pb.StatusRequest(session="sec"))
    assert [w.worker_id for w in status.workers] == ["w0"]


@pytest.mark.parametrize(
    ("metadata", "code"),
    [
        ((("x-recorder-token", TOKEN),), grpc.StatusCode.OK),
        ((("authorization", f"bearer {TOKEN}"),), grpc.StatusCode.OK),
        ((("x-recorder-token", TOKEN[:-1]),), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", f"Basic {TOKEN}"),), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", f"Bearer {TOKEN}x"),), grpc.StatusCode.UNAUTHENTICATED),
    ],
)
def test_token_metadata_forms(secured, metadata, code):
    with grpc.insecure_channel(secured.address) as channel:
        if code == grpc.StatusCode.OK:
            join(channel, metadata=metadata)
        else:
            assert rpc_error(join, channel, metadata=metadata).code() == code


def test_streaming_methods_are_refused_without_token(secured):
    with make_channel(secured.address) as channel:
        stub = pb_grpc.RecorderStub(channel)
        opening = pb.RecordRequest(open=pb.RecordOpen(session="sec", worker_id="w0"))
        record = rpc_error(stub.Record, iter([opening]), timeout=10)
        finish = rpc_error(stub.Finish, pb.FinishRequest(session="sec"), timeout=10)
    for err in (record, finish):
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.details() == MISSING_TOKEN


def test_errors_keep_their_kind_through_the_token_interceptor(secured):
    with make_channel(secured.address, token=TOKEN) as channel:
        join(channel)
        stub = pb_grpc.RecorderStub(channel)
        err = rpc_error(stub.Finish, pb.FinishRequest(session="sec"), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert isinstance(from_rpc_error(err), NoDataError)


def test_unknown_methods_stay_unimplemented(secured):
    with make_channel(secured.address) as channel:
        call = channel.unary_unary("/recorder.v1.Recorder/NoSuchMethod")
        assert rpc_error(call, b"", timeout=10).code() == grpc.StatusCode.UNIMPLEMENTED


def test_token_from_environment(secured, monkeypatch, tmp_path):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with make_channel(secured.address) as channel:
        join(channel, worker="env")
    monkeypatch.delenv(TOKEN_ENV)
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(token_file))
    with make_channel(secured.address) as channel:
        join(channel, worker="env-file")
    # An explicit argument wins over the environment.
    with make_channel(secured.address, token="wrong") as channel:
        assert rpc_error(join, channel).details() == WRONG_TOKEN


def test_load_token(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"\n  {TOKEN}  \n")
    assert load_token(path) == TOKEN
    path.write_text(" \n\t")
    with pytest.raises(ValueError, match="expected a token, got an empty file"):
        load_token(path)
    path.write_text("two words")
    with pytest.raises(ValueError, match="printable ASCII"):
        load_token(path)
    with pytest.raises(OSError):
        load_token(tmp_path / "missing")


def test_client_arguments_are_checked(tmp_path, pki):
    with pytest.raises(ValueError, match="client_certificate and client_key"):
        make_channel("127.0.0.1:1", client_certificate=pki.client_cert)
    with pytest.raises(ValueError, match="root_certificates"):
        make_channel("127.0.0.1:1", root_certificates=tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="token"):
        make_channel("127.0.0.1:1", token="with space")
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="--tls-cert"):
        server_credentials(empty, pki.server_key)


# -- health ------------------------------------------------------------------------
def health_status(address: str, service: str, **channel_kw) -> int:
    with make_channel(address, **channel_kw) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
    return reply.status


def test_health_answers_without_token_and_follows_serving():
    running = start_secured(serving=False)
    try:
        for name in ("", RECORDER_SERVICE_NAME):
            assert health_status(running.address, name) == NOT_SERVING  # starting
        running.set_serving(True)
        for name in ("", RECORDER_SERVICE_NAME):
            assert health_status(running.address, name) == SERVING
        with make_channel(running.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=RECORDER_SERVICE_NAME), timeout=10
            )
            assert next(watch).status == SERVING
            running.set_serving(False)  # draining
            assert next(watch).status == NOT_SERVING
            watch.cancel()
        assert health_status(running.address, "") == NOT_SERVING
    finally:
        running.stop()


def test_health_main(secured, capsys):
    assert health_cli.health_main(secured.address, 5.0) == 0
    assert capsys.readouterr().out.startswith(f"SERVING {secured.address}")
    secured.set_serving(False)
    assert health_cli.health_main(secured.address, 5.0) == 1
    assert capsys.readouterr().out.startswith(f"NOT_SERVING {secured.address}")


def test_health_main_on_a_dead_port(capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert health_cli.health_main(f"127.0.0.1:{port}", 0.5) == 1
    assert capsys.readouterr().out.startswith(f"UNREACHABLE 127.0.0.1:{port}")


def test_health_subcommand_parser(secured, capsys):
    parser = argparse.ArgumentParser(prog="rollout-recorder")
    health_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["health", "--target", secured.address, "--timeout", "5"])
    assert args.func(args) == 0
    assert "SERVING" in capsys.readouterr().out


# -- TLS ---------------------------------------------------------------------------
def test_tls_round_trip(pki):
    running = start_secured(tls=(pki.server_cert, pki.server_key))
    try:
        with make_channel(running.address, token=TOKEN, root_certificates=pki.ca) as channel:
            assert join(channel).worker_index == 0
        # PEM bytes work as well as paths; the token is still required over TLS.
        with make_channel(running.address, root_certificates=pki.ca.read_bytes()) as channel:
            assert rpc_error(join, channel).code() == grpc.StatusCode.UNAUTHENTICATED
        assert health_status(running.address, "", root_certificates=pki.ca) == SERVING
        assert health_cli.health_main(running.address, 5.0, tls_ca=pki.ca) == 0
    finally:
        running.stop()


def test_plaintext_client_against_tls_server_fails_clearly(pki, capsys):
    running = start_secured(tls=(pki.server_cert, pki.server_key))
    try:
        with make_channel(running.address, token=TOKEN) as channel:
            err = rpc_error(join, channel)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        mapped = from_rpc_error(err, running.address)
        assert isinstance(mapped, RecorderUnavailableError)
        assert running.address in str(mapped)
        assert "if the server uses TLS, pass root_certificates" in str(mapped)
        assert health_cli.health_main(running.address, 5.0) == 1
        assert "--tls-ca" in capsys.readouterr().out
    finally:
        running.stop()


def test_tls_client_against_plaintext_server_fails(secured, pki):
    with make_channel(secured.address, token=TOKEN, root_certificates=pki.ca) as channel:
        err = rpc_error(join, channel)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "drop them" in str(from_rpc_error(err, secured.address))


def test_tls_client_refuses_a_server_from_another_ca(pki):
    running = start_secured(tls=(pki.server_cert, pki.server_key))
    try:
        with make_channel(running.address, token=TOKEN, root_certificates=pki.other_ca) as ch:
            assert rpc_error(join, ch).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop()


def test_mutual_tls(pki):
    running = start_secured(tls=(pki.server_cert, pki.server_key), client_ca=pki.ca)
    try:
        good = {"client_certificate": pki.client_cert, "client_key": pki.client_key}
        with make_channel(running.address, token=TOKEN, root_certificates=pki.ca, **good) as ch:
            assert join(ch).worker_index == 0
        with make_channel(running.address, token=TOKEN, root_certificates=pki.ca) as ch:
            assert rpc_error(join, ch).code() == grpc.StatusCode.UNAVAILABLE
        stranger = {"client_certificate": pki.stranger_cert, "client_key": pki.stranger_key}
        with make_channel(running.address, token=TOKEN, root_certificates=pki.ca, **stranger) as ch:
            assert rpc_error(join, ch).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop()


# -- reflection, names, limits -----------------------------------------------------------
def list_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    return [s.name for s in replies[0].list_services_response.service]


def test_reflection_lists_the_recorder_service(secured):
    with make_channel(secured.address, token=TOKEN) as channel:
        names = list_services(channel)
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="recorder.v1.Recorder"
        )
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
    assert RECORDER_SERVICE_NAME == "recorder.v1.Recorder"
    assert "recorder.v1.Recorder" in names
    assert "grpc.health.v1.Health" in names
    assert reply.file_descriptor_response.file_descriptor_proto
    # Reflection describes the API: it needs the token like the recorder itself.
    with make_channel(secured.address) as channel:
        assert rpc_error(list_services, channel).code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("name", ["../../x", "..", "a/b", "/etc/passwd", ".hidden", ""])
def test_session_names_cannot_escape_the_data_directory(secured, name):
    with make_channel(secured.address, token=TOKEN) as channel:
        err = rpc_error(join, channel, session=name)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session" in err.details()


def test_session_and_worker_limits_are_resource_exhausted():
    running = start_secured(limits=ServiceLimits(max_sessions=1, max_workers_per_session=1))
    try:
        with make_channel(running.address, token=TOKEN) as channel:
            join(channel, session="one", worker="w0")
            err = rpc_error(join, channel, session="one", worker="w1")
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            err = rpc_error(join, channel, session="two", worker="w0")
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        running.stop()


def test_client_package_never_imports_health_or_reflection():
    # `import grpc` itself imports the bare grpc_health / grpc_reflection packages
    # when they are installed (aliases grpc.health, grpc.reflection); their
    # services live in the submodules checked here.
    code = (
        "import sys, recorder_client, recorder_client._credentials; "
        "from recorder_client import RolloutRecorder; "
        "bad = sorted(m for m in sys.modules if m.startswith(('grpc_health.', "
        "'grpc_reflection.', 'recorder_server'))); print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# -- through RolloutRecorder (needs the client wiring: token= and make_channel) ------------
def test_rollout_recorder_sends_its_token(secured, monkeypatch):
    from recorder_client import RolloutRecorder

    with RolloutRecorder(target=secured.address, session="rr", token=TOKEN) as rec:
        assert rec.status().session == "rr"
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with RolloutRecorder(target=secured.address, session="rr") as rec:
        assert rec.status().session == "rr"
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(AuthenticationError, match="authentication failed: missing token"):
        RolloutRecorder(target=secured.address, session="rr")
    with pytest.raises(AuthenticationError, match="authentication failed: wrong token"):
        RolloutRecorder(target=secured.address, session="rr", token="nope")


def test_rollout_recorder_over_tls(pki):
    from recorder_client import RolloutRecorder

    running = start_secured(tls=(pki.server_cert, pki.server_key))
    try:
        with RolloutRecorder(
            target=running.address, session="tls", token=TOKEN, root_certificates=pki.ca
        ) as rec:
            assert rec.status().session == "tls"
    finally:
        running.stop()
