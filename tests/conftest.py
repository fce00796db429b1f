"""The test suite: ``tests/unit`` (no server, no socket, no process of flightq's) and
``tests/integration`` (real Flight servers on loopback port 0, real processes).

Shared helpers live beside this file (``helpers_wire``, ``helpers_reliability``,
``fixtures_dataplane``, ``fixtures_shard``; importable as top-level modules, see
``pythonpath`` in pyproject.toml) and the golden streams under ``golden/``.
"""
