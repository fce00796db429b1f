"""Bad input: a typed error naming the cause, nothing stored, the server keeps serving.

Every crafted record batch is sent twice: through the flightq client (``put_batch``,
which sends what it is given) and through a plain ``pyarrow.flight`` client. After each
refusal the partition holds exactly what it held before and the next valid request
succeeds.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, VLM, python_env
from helpers_reliability import (
    add_column,
    partition_state,
    plain_error,
    plain_put,
    put_command,
    text_batch,
    with_field_metadata,
    with_schema_metadata,
)
from helpers_wire import drop_column, replace_column

import flightq

pytestmark = pytest.mark.timeout(120)

REG = flightq.SchemaRegistry.default()
SHAPES = pa.list_(pa.int64())


class WatchedServer(flightq.Server):
    """A real server that also reports how each DoPut ended (for streams cut short)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.put_outcomes: queue.Queue[str] = queue.Queue()

    def do_put(self, context, descriptor, reader, writer):  # type: ignore[no-untyped-def]
        try:
            super().do_put(context, descriptor, reader, writer)
        except BaseException as e:
            self.put_outcomes.put(f"refused: {e}")
            raise
        self.put_outcomes.put("stored")


@pytest.fixture
def served() -> Iterator[tuple[WatchedServer, flightq.Client]]:
    """Partitions 'p' (text, task train, rows k0 k1) and 'v' (vlm), a connected client."""
    with (
        WatchedServer(max_put_batch_bytes=64 * 1024) as srv,
        flightq.connect(srv.location, [TEXT, VLM], timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", TEXT, tasks=["train"])
        c.create_partition("v", VLM)
        c.put_batch("p", text_batch(["k0", "k1"]))
        yield srv, c


def _vlm_batch(keys: list[str], segments: int = 2) -> pa.RecordBatch:
    cols = {
        "input_ids": [np.arange(3, dtype=np.int64) for _ in keys],
        "pixel_values": [[np.full((2, 3), j, np.float32) for j in range(segments)] for _ in keys],
    }
    return flightq.encode(REG.get(VLM), cols, keys)


def _drifted_text() -> flightq.Schema:
    s = REG.get(TEXT)
    fields = [
        dataclasses.replace(f, dtype="int64") if f.name == "input_lengths" else f for f in s.fields
    ]
    return flightq.Schema(s.name, s.version, fields)


def _shapes(rb: pa.RecordBatch, name: str, rows: list[list[int]]) -> pa.RecordBatch:
    return replace_column(rb, name + "__shape", pa.array(rows, type=SHAPES))


NEW = ["n0", "n1"]

#: (id, partition, batches of one put, error class, message)
CASES: list[tuple[str, str, Callable[[], list[pa.RecordBatch]], type, str]] = [
    (
        "wrong dtype in the field metadata",
        "p",
        lambda: [with_field_metadata(text_batch(NEW), "input_ids", **{"flightq.dtype": b"int32"})],
        flightq.DecodeError,
        r"column 'input_ids': field metadata says dtype 'int32', schema rollout_text@1 "
        r"declares 'int64'",
    ),
    (
        "wrong Arrow type of a scalar",
        "p",
        lambda: [replace_column(text_batch(NEW), "input_lengths", pa.array([4, 5], pa.int64()))],
        flightq.DecodeError,
        r"column 'input_lengths': expected Arrow type int32 for role scalar, got int64",
    ),
    (
        "shape and byte length disagree",
        "p",
        lambda: [_shapes(text_batch(NEW), "input_ids", [[5], [5]])],
        flightq.ShapeError,
        r"column 'input_ids': shape \(5,\) needs 40 bytes of int64, payload has 32 "
        r"\(row key 'n0'\)",
    ),
    (
        "negative dim",
        "p",
        lambda: [_shapes(text_batch(NEW), "input_ids", [[4], [-5]])],
        flightq.ShapeError,
        r"column 'input_ids': expected dims >= 0, got shape \(-5,\) \(row key 'n1'\)",
    ),
    (
        "dim too large for any payload",
        "p",
        lambda: [_shapes(text_batch(NEW), "input_ids", [[2**62], [5]])],
        flightq.ShapeError,
        r"column 'input_ids': shape \(4611686018427387904,\) needs \d+ bytes, more than a "
        r"payload may hold \(2\*\*62\) \(row key 'n0'\)",
    ),
    (
        "a dim whose byte length wraps around int64 to the payload's",
        "p",
        lambda: [_shapes(text_batch(NEW), "input_ids", [[2**61 + 4], [5]])],
        flightq.ShapeError,
        r"column 'input_ids': shape \(2305843009213693956,\) needs \d+ bytes, more than a "
        r"payload may hold \(2\*\*62\) \(row key 'n0'\)",
    ),
    (
        "a negative dim whose byte length wraps around int64 to the payload's",
        "p",
        lambda: [_shapes(text_batch(NEW), "input_ids", [[-(2**61) + 4], [5]])],
        flightq.ShapeError,
        r"column 'input_ids': expected dims >= 0, got shape \(-2305843009213693948,\) "
        r"\(row key 'n0'\)",
    ),
    (
        "dims whose product overflows int64",
        "v",
        lambda: [
            replace_column(
                _vlm_batch(["m0"], segments=1),
                "pixel_values__shape",
                pa.array([[[2**32, 2**32]]], type=pa.large_list(SHAPES)),
            )
        ],
        flightq.ShapeError,
        r"column 'pixel_values': shape \(4294967296, 4294967296\) needs \d+ bytes, more than "
        r"a payload may hold \(2\*\*62\) \(row key 'm0'\)",
    ),
    (
        "missing shape column",
        "p",
        lambda: [drop_column(text_batch(NEW), "input_ids__shape")],
        flightq.ShapeError,
        r"column 'input_ids': has no shape column 'input_ids__shape'; tensors travel with "
        r"their shapes",
    ),
    (
        "extra shape column without payload",
        "p",
        lambda: [add_column(text_batch(NEW), "advantages__shape", pa.array([[1], [1]], SHAPES))],
        flightq.DecodeError,
        r"shape column 'advantages__shape' has no payload column 'advantages'",
    ),
    (
        "extra shape column on a scalar",
        "p",
        lambda: [add_column(text_batch(NEW), "input_lengths__shape", pa.array([[], []], SHAPES))],
        flightq.DecodeError,
        r"shape column 'input_lengths__shape': scalar field 'input_lengths' has no shape",
    ),
    (
        "shape count differs from segment count",
        "v",
        lambda: [
            replace_column(
                _vlm_batch(["m0"], segments=2),
                "pixel_values__shape",
                pa.array([[[2, 3]]], type=pa.large_list(SHAPES)),
            )
        ],
        flightq.ShapeError,
        r"column 'pixel_values': 2 segments but 1 shapes \(row key 'm0'\)",
    ),
    (
        "undeclared column",
        "p",
        lambda: [add_column(text_batch(NEW), "frob", pa.array([1, 2]))],
        flightq.UndeclaredFieldError,
        r"column 'frob' is not declared by schema rollout_text@1",
    ),
    (
        "missing required column",
        "p",
        lambda: [drop_column(drop_column(text_batch(NEW), "input_ids"), "input_ids__shape")],
        flightq.MissingFieldError,
        r"row key 'n0' is new in partition 'p' and lacks required field\(s\) \['input_ids'\]",
    ),
    (
        "duplicate keys in one batch",
        "p",
        lambda: [replace_column(text_batch(NEW), "__key__", pa.array(["n0", "n0"]))],
        flightq.EncodeError,
        r"duplicate row key 'n0' within one batch",
    ),
    (
        "duplicate keys across the batches of one put",
        "p",
        lambda: [text_batch(["n0"]), text_batch(["n0"], seed=1)],
        flightq.EncodeError,
        r"duplicate row key 'n0' within one put",
    ),
    (
        "fingerprint differs from the partition's",
        "p",
        lambda: [
            flightq.encode(_drifted_text(), {"input_ids": [np.arange(3)] * 2}, NEW),
        ],
        flightq.SchemaMismatchError,
        r"batch carries schema rollout_text@1 \(\w+\), expected rollout_text@1 \(\w+\): "
        r"field 'input_lengths': dtype expected 'int32', actual 'int64'",
    ),
    (
        "another schema's batch",
        "p",
        lambda: [_vlm_batch(NEW)],
        flightq.SchemaMismatchError,
        r"batch carries schema rollout_vlm@1",
    ),
    (
        "fingerprint that does not match the declarations carried",
        "p",
        lambda: [with_schema_metadata(text_batch(NEW), **{"flightq.fingerprint": b"0" * 16})],
        flightq.DecodeError,
        r"metadata fingerprint '0000000000000000' does not match its declarations",
    ),
    (
        "tags that are not msgpack",
        "p",
        lambda: [replace_column(text_batch(NEW), "__tags__", pa.array([None, b"\xc1"]))],
        flightq.EncodeError,
        r"tags of row 'n1' are not valid msgpack",
    ),
    (
        "tags that are truncated msgpack",
        "p",
        lambda: [
            replace_column(
                text_batch(NEW), "__tags__", pa.array([msgpack.packb({"step": 1})[:-1], None])
            )
        ],
        flightq.EncodeError,
        r"tags of row 'n0' are not valid msgpack",
    ),
    (
        "tags that are not a map",
        "p",
        lambda: [replace_column(text_batch(NEW), "__tags__", pa.array([msgpack.packb([1]), None]))],
        flightq.EncodeError,
        r"tags of row 'n0' must be a msgpack map, got list",
    ),
    (
        "a record batch over the server's size limit",
        "p",
        lambda: [
            flightq.encode(REG.get(TEXT), {"input_ids": [np.zeros(10_000, np.int64)] * 2}, NEW)
        ],
        flightq.ProtocolError,
        r"put to 'p': a record batch of \d+ bytes exceeds the server's limit of 65536 bytes",
    ),
]


def _assert_serves_on(c: flightq.Client, location: str, partition: str) -> None:
    """The next valid requests succeed, from both kinds of client."""
    if partition == "v":
        assert c.put_batch("v", _vlm_batch(["ok"])) == 1
    else:
        assert c.put_batch("p", text_batch(["ok"])) == 1
        assert c.get("p", ["k0", "ok"], as_="numpy").keys == ["k0", "ok"]
    with fl.connect(location) as plain:
        (res,) = list(plain.do_action(fl.Action("health", b"")))
        assert msgpack.unpackb(res.body.to_pybytes())["ok"] is True


@pytest.mark.parametrize(
    ("partition", "build", "cls", "cause"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_a_bad_put_is_refused_typed_through_both_clients_and_nothing_changes(
    served, partition, build, cls, cause
):
    srv, c = served
    before = partition_state(srv.location, partition)
    with pytest.raises(cls, match=cause) as exc:
        c.put_batch(partition, build())
    assert type(exc.value) is cls
    assert partition_state(srv.location, partition) == before

    batches = build()
    with pytest.raises(fl.FlightServerError, match=f"{cls.__name__}: .*{cause}") as plain_exc:
        plain_put(srv.location, put_command(partition), batches)
    kind, message = plain_error(plain_exc.value)
    assert kind == cls.__name__
    assert message == str(exc.value)
    assert partition_state(srv.location, partition) == before
    _assert_serves_on(c, srv.location, partition)


@pytest.mark.parametrize(
    ("put", "cls", "cause"),
    [
        (
            lambda c: c.put("p", ["n0"], {"input_ids": [np.arange(3, dtype=np.int32)]}),
            flightq.DTypeError,
            r"column 'input_ids': expected dtype int64, got int32 \(row key 'n0'\)",
        ),
        (
            lambda c: c.put("p", ["n0"], {"input_ids": [np.zeros((2, 2), np.int64)]}),
            flightq.ShapeError,
            r"column 'input_ids'.*\(row key 'n0'\)",
        ),
        (
            lambda c: c.put("p", ["n0"], {"input_ids": [np.arange(3)], "frob": [1]}),
            flightq.UndeclaredFieldError,
            r"column 'frob' is not declared by schema rollout_text@1",
        ),
        (
            lambda c: c.put("p", ["n0", "n0"], {"input_ids": [np.arange(3)] * 2}),
            flightq.EncodeError,
            r"duplicate row key 'n0' within one put",
        ),
        (
            lambda c: c.put("p", ["n0"], {"total_reward": np.ones(1, np.float32)}),
            flightq.MissingFieldError,
            r"row key 'n0' is new in partition 'p' and lacks required field\(s\)",
        ),
        (
            lambda c: c.put("p", ["n0"], {"input_ids": [np.arange(3)]}, [{"x": object()}]),
            flightq.EncodeError,
            r"tags of row 'n0' are not msgpack-serialisable",
        ),
        (
            lambda c: c.put("nope", ["n0"], {"input_ids": [np.arange(3)]}),
            flightq.NotFoundError,
            r"unknown partition 'nope'$",
        ),
        (
            lambda c: c.claim("p", "frob", 1, as_="numpy", timeout=1),
            flightq.NotFoundError,
            r"partition 'p' declares no task 'frob'; declared: \['train'\]",
        ),
        (
            lambda c: c.get("p", ["k0", "zz"]),
            flightq.NotFoundError,
            r"partition 'p' has no row key 'zz'",
        ),
        (
            lambda c: c.reset("p", "train", ["zz"]),
            flightq.NotFoundError,
            r"partition 'p' has no row key 'zz'",
        ),
    ],
)
def test_bad_python_data_or_names_through_the_client_are_typed_and_change_nothing(
    served, put, cls, cause
):
    srv, c = served
    before = partition_state(srv.location, "p")
    with pytest.raises(cls, match=cause) as exc:
        put(c)
    assert type(exc.value) is cls
    assert partition_state(srv.location, "p") == before
    _assert_serves_on(c, srv.location, "p")


_GOOD_TICKET = msgpack.packb({"op": "get", "partition": "p", "keys": ["k0"], "fields": None})
_BODIES = [
    (b"\xc1\x00garbage", r"not a valid msgpack map"),
    (_GOOD_TICKET[:-3], r"not a valid msgpack map"),
    (b"\xdf\xff\xff\xff\xff", r"not a valid msgpack map"),  # a map of 2**32 - 1 entries
    (b"\x81\xa2op\xdb\xff\xff\xff\xf0", r"not a valid msgpack map"),  # a 4 GiB string
    (b"\x91" * 100_000, r"not a valid msgpack map|expected a msgpack map"),  # deep nesting
    (msgpack.packb("p"), r"expected a msgpack map, got str"),
]


@pytest.mark.parametrize(("body", "cause"), _BODIES, ids=range(len(_BODIES)))
def test_malformed_tickets_actions_and_descriptors_name_the_cause(served, body, cause):
    srv, c = served
    before = partition_state(srv.location, "p")
    with fl.connect(srv.location) as plain:
        calls = [
            lambda: plain.do_get(fl.Ticket(body)).read_all(),
            lambda: list(plain.do_action(fl.Action("describe", body))),
            lambda: list(plain.do_action(fl.Action("clear", body))),
            lambda: plain.get_flight_info(fl.FlightDescriptor.for_command(body)),
            lambda: plain_put(
                srv.location, fl.FlightDescriptor.for_command(body), [text_batch(["n0"])]
            ),
        ]
        for call in calls:
            with pytest.raises(fl.FlightServerError, match=f"ProtocolError: .*{cause}") as exc:
                call()
            assert plain_error(exc.value)[0] == "ProtocolError"
    assert partition_state(srv.location, "p") == before
    _assert_serves_on(c, srv.location, "p")


def test_a_put_that_ends_before_the_rows_it_announced_stores_nothing(served):
    srv, _ = served
    before = partition_state(srv.location, "p")
    whole = text_batch(["n0", "n1", "n2", "n3"])
    with pytest.raises(
        fl.FlightServerError,
        match=r"ProtocolError: put to 'p': the stream ended after 2 of the 4 rows announced; "
        r"nothing was stored",
    ):
        plain_put(srv.location, put_command("p", rows=4), [whole.slice(0, 2)])
    assert partition_state(srv.location, "p") == before
    assert plain_put(srv.location, put_command("p", rows=4), [whole]) == {"rows": 4}


_CUT_WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    import pyarrow.flight as fl
    from helpers_reliability import put_command, text_batch
    whole = text_batch(["n0", "n1", "n2", "n3"])
    c = fl.connect(sys.argv[1])
    writer, _ = c.do_put(put_command("p"), whole.schema)   # announces no row count
    writer.write_batch(whole.slice(0, 2))
    print("half sent", flush=True)
    time.sleep(120)
    """
)


def test_a_writer_killed_mid_put_stores_nothing(served):
    srv, c = served
    before = partition_state(srv.location, "p")
    while not srv.put_outcomes.empty():  # the fixture's own put
        srv.put_outcomes.get_nowait()
    received = c.stats()["counters"]["bytes_received"]
    tests_dir = str(__import__("pathlib").Path(__file__).parents[1])
    proc = subprocess.Popen(
        [sys.executable, "-c", _CUT_WRITER, srv.location, tests_dir],
        stdout=subprocess.PIPE,
        text=True,
        env=python_env(),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "half sent"
        # Killed once the server has read the half: "half sent" means gRPC took the
        # batch, which may still sit in the writer's buffers (a call whose first message
        # never arrives waits inside Flight until the idle timeout, not on this test).
        deadline = time.monotonic() + TIMEOUT
        while c.stats()["counters"]["bytes_received"] == received:
            assert time.monotonic() < deadline, "the server never read the half put"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    outcome = srv.put_outcomes.get(timeout=TIMEOUT)
    assert outcome.startswith("refused: ProtocolError: put to 'p': "), outcome
    assert partition_state(srv.location, "p") == before
    _assert_serves_on(c, srv.location, "p")
    # The same keys, written whole, land: nothing of the cut put was left behind.
    assert c.put_batch("p", text_batch(["n0", "n1", "n2", "n3"], seed=3)) == 4
