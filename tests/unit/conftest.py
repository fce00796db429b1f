"""Unit tests: the data model, the protocol's messages and the architecture, no network.

A unit test that starts a flightq server fails at once, naming the test: it belongs in
``tests/integration``. Tests that need torch are marked ``torch`` or take the ``torch``
fixture (see ``tests/conftest.py``), so the rest run where torch is absent (``make test``
runs them so in a second environment).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _no_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from flightq.server.flight import Server

    name = request.node.nodeid

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{name} starts a flightq server: move it to tests/integration")

    monkeypatch.setattr(Server, "__init__", refuse)
    yield
