"""Bearer-token authentication and TLS material for the Flight edges.

The server checks every call's ``authorization: Bearer <token>`` header in Flight server
middleware, before any handler runs: a call without a valid token is refused with
``UNAUTHENTICATED`` and touches no data. Tokens are compared as SHA-256 digests in
constant time and never appear in a message, a log line or a ``repr``.

TLS is plain Arrow Flight TLS: the server listens on ``grpc+tls://`` with a certificate
and key read from PEM files; a client passes the CA (or the self-signed certificate) as
``tls_root_certs``.

Examples
--------
>>> import flightq
>>> with flightq.Server(tokens=["s3cret"]) as srv:
...     with flightq.connect(srv.location, token="s3cret") as c:
...         c.health()["ok"]
True
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow.flight as fl

from .errors import ProtocolError

__all__ = [
    "HEADER",
    "TOKENS_ENV",
    "BearerTokenServerMiddlewareFactory",
    "BearerTokenClientMiddlewareFactory",
    "read_tokens",
    "tls_certificates",
    "read_pem",
]

#: The header that carries the token (gRPC metadata keys are lower case).
HEADER = "authorization"
#: Environment variable a server reads its accepted tokens from (one per line), so that
#: they never appear on a command line.
TOKENS_ENV = "FLIGHTQ_TOKENS"

_REFUSED = (
    "UnauthenticatedError: this flightq server requires a valid bearer token "
    "(connect(..., token=...)); the request carried {what}"
)


def _digest(token: str | bytes) -> bytes:
    raw = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(raw).digest()


class _Authenticated(fl.ServerMiddleware):
    """Marks a call that passed the token check (nothing to do per call)."""


class BearerTokenServerMiddlewareFactory(fl.ServerMiddlewareFactory):
    """Refuse every call whose ``authorization`` header is not ``Bearer <accepted token>``.

    Parameters
    ----------
    tokens:
        Accepted tokens (non-empty strings). Only their SHA-256 digests are kept.

    Raises
    ------
    ProtocolError
        If no token, or an empty one, is given.
    """

    def __init__(self, tokens: Iterable[str]) -> None:
        super().__init__()
        digests = []
        for t in tokens:
            if not isinstance(t, str) or not t.strip():
                raise ProtocolError("bearer tokens must be non-empty strings")
            digests.append(_digest(t.strip()))
        if not digests:
            raise ProtocolError("token authentication needs at least one accepted token")
        self._digests = tuple(digests)

    def __repr__(self) -> str:
        return f"BearerTokenServerMiddlewareFactory({len(self._digests)} tokens)"

    def start_call(self, info: fl.CallInfo, headers: dict[str, Any]) -> fl.ServerMiddleware:
        values = headers.get(HEADER) or headers.get(HEADER.title()) or []
        if not values:
            raise fl.FlightUnauthenticatedError(_REFUSED.format(what="no token"))
        for v in values:
            text = v.decode(errors="replace") if isinstance(v, bytes) else str(v)
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token:
                continue
            d = _digest(token.strip())
            # Compare against every accepted digest, so timing says nothing about which.
            ok = False
            for want in self._digests:
                ok |= hmac.compare_digest(d, want)
            if ok:
                return _Authenticated()
        raise fl.FlightUnauthenticatedError(_REFUSED.format(what="an invalid token"))


class _BearerClientMiddleware(fl.ClientMiddleware):
    def __init__(self, header: str) -> None:
        super().__init__()
        self._header = header

    def sending_headers(self) -> dict[str, str]:
        return {HEADER: self._header}


class BearerTokenClientMiddlewareFactory(fl.ClientMiddlewareFactory):
    """Add ``authorization: Bearer <token>`` to every call of a Flight client.

    Parameters
    ----------
    token:
        The bearer token; kept privately, never shown by ``repr``.
    """

    def __init__(self, token: str) -> None:
        super().__init__()
        if not isinstance(token, str) or not token.strip():
            raise ProtocolError("a bearer token must be a non-empty string")
        self._header = f"Bearer {token.strip()}"

    def __repr__(self) -> str:
        return "BearerTokenClientMiddlewareFactory(<token hidden>)"

    def start_call(self, info: fl.CallInfo) -> fl.ClientMiddleware:
        return _BearerClientMiddleware(self._header)


def read_tokens(path: str | os.PathLike[str] | None = None) -> list[str]:
    """Accepted tokens, one per line, from a file or (``path`` None) :data:`TOKENS_ENV`.

    Blank lines and lines starting with ``#`` are skipped.

    Raises
    ------
    ProtocolError
        If the file cannot be read or holds no token.
    """
    if path is None:
        text = os.environ.get(TOKENS_ENV, "")
        where = f"${TOKENS_ENV}"
    else:
        where = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ProtocolError(f"cannot read tokens from {where}: {e.strerror}") from e
    tokens = [s.strip() for s in text.splitlines() if s.strip() and not s.strip().startswith("#")]
    if not tokens:
        raise ProtocolError(f"no bearer token in {where}")
    return tokens


def read_pem(path: str | os.PathLike[str]) -> bytes:
    """A PEM file's bytes.

    Raises
    ------
    ProtocolError
        If it cannot be read or is not PEM.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ProtocolError(f"cannot read {str(path)!r}: {e.strerror}") from e
    if b"-----BEGIN " not in data:
        raise ProtocolError(f"{str(path)!r} is not a PEM file")
    return data


def tls_certificates(
    cert_file: str | os.PathLike[str], key_file: str | os.PathLike[str]
) -> list[fl.CertKeyPair]:
    """The ``tls_certificates`` argument of a TLS server, from PEM files."""
    return [fl.CertKeyPair(read_pem(cert_file), read_pem(key_file))]
