"""Two command-line trips: a bare ``host:port`` location, and options before the action.

A location without a scheme means ``grpc://host:port`` for every client and command;
``flightq`` takes a command's options before or after the command (and schema's action).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from fixtures_dataplane import TEXT, TIMEOUT

import flightq
from flightq.cli import main

pytestmark = pytest.mark.timeout(120)


def test_a_bare_host_port_location_means_grpc() -> None:
    with flightq.Server() as srv:
        bare = srv.location.removeprefix("grpc://")
        with flightq.connect(bare, [TEXT], timeout=TIMEOUT) as c:
            assert c.location == srv.location
            c.create_partition("r", TEXT)
        with flightq.Writer(bare, "r") as w:  # every client that takes a location
            w.put(["a_g0"], {"input_ids": [np.arange(3)]})
        assert flightq.connect(srv.location).inspect("r")["rows"] == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["stats", "{loc}", "--json"],
        ["--json", "stats", "{loc}"],
        ["inspect", "--json", "{loc}", "r"],
        ["--json", "inspect", "{loc}", "r"],
    ],
)
def test_options_go_before_or_after_the_command(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with flightq.Server() as srv, flightq.connect(srv.location) as c:
        c.create_partition("r", TEXT)
        bare = srv.location.removeprefix("grpc://")
        assert main([a.format(loc=bare) for a in argv]) == 0
        json.loads(capsys.readouterr().out)  # --json took effect wherever it stood


@pytest.mark.parametrize(
    "argv",
    [
        ["schema", "list", "--schemas", "{dir}"],
        ["schema", "--schemas", "{dir}", "list"],
        ["--schemas", "{dir}", "schema", "list"],
        ["schema", "--json", "--schemas", "{dir}", "show", "rollout_text@1"],
    ],
)
def test_options_go_before_or_after_schemas_action(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    reg = flightq.SchemaRegistry.default()
    (tmp_path / "rollout_text").mkdir()
    (tmp_path / "rollout_text" / "v1.json").write_text(reg.get(TEXT).canonical_json)
    assert main([a.format(dir=tmp_path) for a in argv]) == 0
    out = capsys.readouterr().out
    assert "rollout_text" in out and "rollout_vlm" not in out  # the folder, not the shipped
