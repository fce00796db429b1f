"""TLS and bearer-token authentication: no valid token, no data; tokens never leak.

A throwaway self-signed certificate (``cryptography``) is generated per test module for
127.0.0.1. Every server is real, on loopback port 0.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.flight as fl
import pytest
from fixtures_dataplane import ROOT, TEXT, TIMEOUT, python_env, text_columns
from helpers_reliability import put_command, text_batch

import flightq
from flightq.auth import (
    BearerTokenClientMiddlewareFactory,
    read_pem,
    read_tokens,
    tls_certificates,
)

cryptography = pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOKEN = "tok-9f3c1a7e5b2d4c6e8a0b"
OTHER = "tok-0000-wrong-0000"
SERVE = [sys.executable, "-m", "flightq.cli", "serve", "--port", "0"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cert.pem, key.pem): a self-signed certificate for 127.0.0.1 and localhost."""
    d = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flightq-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = d / "cert.pem", d / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


class CountingServer(flightq.Server):
    """A real server that counts the calls that reached a handler."""

    handled = 0

    def do_put(self, context, descriptor, reader, writer):  # type: ignore[no-untyped-def]
        type(self).handled += 1
        return super().do_put(context, descriptor, reader, writer)

    def do_get(self, context, ticket):  # type: ignore[no-untyped-def]
        type(self).handled += 1
        return super().do_get(context, ticket)

    def do_action(self, context, action):  # type: ignore[no-untyped-def]
        type(self).handled += 1
        return super().do_action(context, action)


@pytest.fixture
def secure(certs: tuple[Path, Path]) -> Iterator[tuple[CountingServer, bytes]]:
    """A TLS server that requires TOKEN, with partition 'p' holding one row."""
    cert, key = certs
    with CountingServer(
        "grpc+tls://127.0.0.1:0", tls_certificates=tls_certificates(cert, key), tokens=[TOKEN]
    ) as srv:
        root = read_pem(cert)
        with flightq.connect(srv.location, [TEXT], token=TOKEN, tls_root_certs=root) as c:
            c.create_partition("p", TEXT, tasks=["train"])
            c.put("p", ["k0"], text_columns(["k0"]))
        CountingServer.handled = 0
        yield srv, root


@pytest.mark.torch
def test_a_client_with_the_token_over_tls_reads_and_writes(secure):
    srv, root = secure
    assert srv.location.startswith("grpc+tls://127.0.0.1:")
    with flightq.connect(srv.location, [TEXT], token=TOKEN, tls_root_certs=root) as c:
        assert c.put("p", ["k1"], text_columns(["k1"])) == 1
        assert c.claim("p", "train", 2, timeout=TIMEOUT).keys == ["k0", "k1"]
    # A plain Flight client sends the header itself.
    options = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    with fl.connect(srv.location, tls_root_certs=root) as plain:
        info = plain.get_flight_info(fl.FlightDescriptor.for_path("p"), options=options)
        assert info.total_records == 2


@pytest.mark.parametrize(
    ("token", "carried"), [(None, "no token"), (OTHER, "an invalid token"), ("", None)]
)
def test_a_request_without_a_valid_token_is_refused_before_it_touches_data(secure, token, carried):
    srv, root = secure
    if token == "":
        with pytest.raises(flightq.ProtocolError, match=r"non-empty string"):
            flightq.Client(srv.location, token=token, tls_root_certs=root)
        return
    with flightq.Client(srv.location, token=token, tls_root_certs=root, timeout=TIMEOUT) as c:
        calls = [
            lambda: c.health(),
            lambda: c.put("p", ["evil"], text_columns(["evil"])),
            lambda: c.get("p", ["k0"]),
            lambda: c.claim("p", "train", 1, as_="numpy", timeout=0.1),
            lambda: c.clear("p"),
            lambda: c.drop("p"),
            lambda: c.partitions(),
        ]
        for call in calls:
            with pytest.raises(
                flightq.UnauthenticatedError, match=rf"requires a valid bearer token.*{carried}"
            ) as exc:
                call()
            assert isinstance(exc.value, PermissionError)
            assert TOKEN not in str(exc.value) and OTHER not in str(exc.value)
    with pytest.raises(flightq.UnauthenticatedError):
        flightq.connect(srv.location, [TEXT], token=token, tls_root_certs=root)
    # A plain client's put is refused too.
    with fl.connect(srv.location, tls_root_certs=root) as plain:
        batch = text_batch(["evil2"])
        with pytest.raises(fl.FlightUnauthenticatedError):
            writer, reader = plain.do_put(put_command("p"), batch.schema)
            with writer:  # the refusal surfaces on the first read or on close
                writer.write_batch(batch)
                writer.done_writing()
                reader.read()
    assert CountingServer.handled == 0  # no handler ran: nothing was read or written
    with flightq.connect(srv.location, token=TOKEN, tls_root_certs=root) as c:
        info = c.inspect("p")
        assert (info["rows"], info["delivered"]) == (1, {"train": 0})


def test_a_plain_or_unverified_client_cannot_talk_to_a_tls_server(secure):
    srv, _ = secure
    port = srv.location.rsplit(":", 1)[1]
    with pytest.raises(flightq.UnavailableError, match=r"server unavailable"):
        flightq.connect(f"grpc://127.0.0.1:{port}", token=TOKEN, timeout=5)
    with pytest.raises(flightq.UnavailableError, match=r"server unavailable"):
        flightq.connect(srv.location, token=TOKEN, timeout=5)  # no root certificate
    with fl.connect(f"grpc://127.0.0.1:{port}") as plain, pytest.raises(fl.FlightError):
        list(plain.do_action(fl.Action("health", b""), fl.FlightCallOptions(timeout=5)))
    assert CountingServer.handled == 0


def test_tokens_never_appear_in_reprs_messages_or_server_output(certs, tmp_path):
    assert TOKEN not in repr(BearerTokenClientMiddlewareFactory(TOKEN))
    cert, key = certs
    env = python_env()
    env["FLIGHTQ_TOKENS"] = f"# accepted\n{TOKEN}\n"
    proc = subprocess.Popen(
        [*SERVE, "--tls-cert", str(cert), "--tls-key", str(key), "--tokens-from-env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
    )
    try:
        assert proc.stdout is not None
        location = json.loads(proc.stdout.readline())["listening"]
        assert location.startswith("grpc+tls://")
        root = read_pem(cert)
        with flightq.connect(location, token=TOKEN, tls_root_certs=root) as c:
            c.create_partition("p", TEXT)
        for token in (OTHER, None):
            with pytest.raises(flightq.UnauthenticatedError) as exc:
                flightq.connect(location, token=token, tls_root_certs=root)
            assert TOKEN not in str(exc.value) and OTHER not in str(exc.value)
    finally:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert TOKEN not in out + err and OTHER not in out + err


def test_tokens_come_from_a_file_or_the_environment_and_must_exist(tmp_path, monkeypatch):
    f = tmp_path / "tokens"
    f.write_text("# comment\n\n a \nb\n")
    assert read_tokens(f) == ["a", "b"]
    monkeypatch.setenv("FLIGHTQ_TOKENS", "c\n")
    assert read_tokens() == ["c"]
    f.write_text("# nothing\n")
    with pytest.raises(flightq.ProtocolError, match=r"no bearer token in"):
        read_tokens(f)
    with pytest.raises(flightq.ProtocolError, match=r"cannot read tokens from"):
        read_tokens(tmp_path / "missing")
    with pytest.raises(flightq.ProtocolError, match=r"at least one accepted token"):
        flightq.Server(tokens=[])
