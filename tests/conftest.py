"""The test suite: ``tests/unit`` (no server, no socket, no process of flightq's) and
``tests/integration`` (real Flight servers on loopback port 0, real processes).

Shared helpers live beside this file (``helpers_wire``, ``helpers_reliability``,
``fixtures_dataplane``, ``fixtures_shard``; importable as top-level modules, see
``pythonpath`` in pyproject.toml) and the golden streams under ``golden/``.

torch is optional, here as in flightq: no test module imports it at the top. A test that
needs it is marked ``torch`` (``@pytest.mark.torch``, or ``pytestmark`` for a module) or
asks for the ``torch`` fixture, which marks it too; where torch is not installed those
tests skip, saying so, and the rest run (``make test`` runs the suite so in a second
environment).
"""

from __future__ import annotations

from types import ModuleType

import pytest
from helpers_wire import HAS_TORCH


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: the mark lands before ``-m torch`` / ``-m "not torch"`` selects on it.
    skip = pytest.mark.skip(reason="torch is not installed")
    for item in items:
        if "torch" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.torch)
        if not HAS_TORCH and item.get_closest_marker("torch") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def torch() -> ModuleType:
    """The torch module, imported on first use (its tests skip where it is absent)."""
    return pytest.importorskip("torch", reason="torch is not installed")
