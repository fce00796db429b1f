"""Property-based fuzzing: hostile bytes give typed errors, never a crash or a foreign error.

The decoder (:func:`flightq.decode`, :func:`flightq.validation.validate`) gets mutated IPC
streams, record batches with a buffer overwritten, and random bytes; the server gets
random tickets, action bodies and descriptors from a plain Flight client. Longer runs:
``fuzz/`` (atheris).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, VLM
from helpers_reliability import text_batch
from helpers_wire import ipc_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flightq
from flightq.errors import ERROR_CLASSES
from flightq.protocol import ACTIONS
from flightq.validation import validate

pytestmark = pytest.mark.timeout(240)

REG = flightq.SchemaRegistry.default()
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _seeds() -> list[pa.RecordBatch]:
    rng = np.random.default_rng(0)
    text = flightq.encode(
        REG.get(TEXT),
        {
            "input_ids": [rng.integers(0, 9, size=n) for n in (3, 0, 5)],
            "input_lengths": np.array([3, 0, 5], np.int32),
            "total_reward": np.array([0.5, 1.0, -1.0], np.float32),
        },
        ["a", "b", "c"],
        [{"step": 1}, None, {"w": "v"}],
    )
    vlm = flightq.encode(
        REG.get(VLM),
        {
            "input_ids": [np.arange(4), np.arange(2)],
            "pixel_values": [[np.ones((2, 3), np.float32), np.zeros((1, 3), np.float32)], []],
            "image_grid_thw": [[np.array([[1, 2, 3]])], []],
        },
        ["v0", "v1"],
    )
    return [text, vlm]


SEEDS = _seeds()
SEED_BYTES = [ipc_bytes(b) for b in SEEDS]


def _decode_fully(batch: pa.RecordBatch) -> None:
    """Decode every field and the tags, so lazy paths run too; FlightqError is fine."""
    try:
        validate(batch)
        b = flightq.decode(batch, as_="numpy")
        seen = [b[name] for name in b.fields]
        seen.append(b.tags)
    except flightq.FlightqError:
        pass


def _batches_of(data: bytes) -> list[pa.RecordBatch]:
    """The batches pyarrow reads from (possibly corrupt) IPC bytes; [] when it refuses."""
    try:
        return list(pa.ipc.open_stream(pa.py_buffer(data)))
    except (pa.ArrowException, OSError, ValueError):
        return []  # refused by Arrow itself: the server turns that into a ProtocolError


@settings(FUZZ, max_examples=400)
@given(
    seed=st.sampled_from(range(len(SEED_BYTES))),
    edits=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), min_size=1, max_size=8),
    cut=st.one_of(st.none(), st.integers(0, 2**20)),
)
def test_decode_of_a_mutated_ipc_stream_raises_only_flightq_errors(seed, edits, cut):
    data = bytearray(SEED_BYTES[seed])
    for pos, value in edits:
        data[pos % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    for batch in _batches_of(bytes(data)):
        _decode_fully(batch)


@FUZZ
@given(data=st.binary(max_size=4096))
def test_decode_of_random_bytes_raises_only_flightq_errors(data):
    for batch in _batches_of(data):
        _decode_fully(batch)


@FUZZ
@given(
    seed=st.sampled_from(range(len(SEEDS))),
    column=st.integers(0, 100),
    buffer=st.integers(0, 10),
    fill=st.binary(min_size=1, max_size=64),
)
def test_decode_of_a_batch_with_an_overwritten_buffer_raises_only_flightq_errors(
    seed, column, buffer, fill
):
    rb = SEEDS[seed]
    i = column % rb.num_columns
    col = rb.column(i)
    bufs = col.buffers()
    j = buffer % len(bufs)
    if bufs[j] is None:
        return
    size = bufs[j].size
    junk = (fill * (size // len(fill) + 1))[:size]
    bufs[j] = pa.py_buffer(junk)
    try:
        arr = _from_buffers(col.type, len(col), bufs)
    except (pa.ArrowException, ValueError):
        return
    arrays = list(rb.columns)
    arrays[i] = arr
    _decode_fully(pa.RecordBatch.from_arrays(arrays, schema=rb.schema))


def _from_buffers(t: pa.DataType, n: int, bufs: list[Any]) -> pa.Array:
    """Rebuild an array of type ``t`` (nested types included) from its flattened buffers."""
    if t.num_fields == 0 or pa.types.is_dictionary(t):
        if pa.types.is_dictionary(t):
            raise ValueError("dictionary arrays are rebuilt with their dictionary; skip")
        return pa.Array.from_buffers(t, n, bufs)
    own = 2 if pa.types.is_list(t) or pa.types.is_large_list(t) else 1
    child_t = t.value_type
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if pa.types.is_large_list(t) else np.int32)
    child_n = int(offsets[n]) if len(offsets) > n else 0
    child = _from_buffers(child_t, max(child_n, 0), bufs[own:])
    return pa.Array.from_buffers(t, n, bufs[:own], children=[child])


# --------------------------------------------------------------------------- server inputs


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[flightq.Server]:
    with flightq.Server() as srv:
        with flightq.connect(srv.location, timeout=30) as c:
            c.create_partition("p", TEXT, tasks=["train"])
            c.put_batch("p", text_batch([f"k{i}" for i in range(8)]))
        yield srv


_FIELD_NAMES = st.sampled_from(["input_ids", "input_lengths", "prev_logprobs", "frob", ""])
_ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
_TICKETS = st.one_of(
    st.binary(max_size=64),
    st.builds(
        lambda d: msgpack.packb(d, use_bin_type=True),
        st.fixed_dictionaries(
            {},
            optional={
                "op": st.sampled_from(["get", "claim", "scan", "frob"]) | _ANY,
                "partition": st.sampled_from(["p", "nope", "", "p/q"]) | _ANY,
                "keys": st.lists(st.sampled_from(["k0", "k1", "zz"]) | _ANY, max_size=4) | _ANY,
                "fields": st.none() | st.lists(_FIELD_NAMES, max_size=3) | _ANY,
                "task": st.sampled_from(["train", "x"]) | _ANY,
                "batch_size": st.integers(-2, 20) | _ANY,
                # Bounded: a valid claim waits at most this long.
                "timeout": st.floats(0, 0.02) | st.just(float("nan")) | st.text(max_size=3),
                "wait_for": st.none() | st.lists(_FIELD_NAMES, max_size=2) | _ANY,
            },
        ),
    ),
)


def _typed_or_ok(call: Any) -> None:
    """``call()`` succeeds or fails with a Flight error carrying a known flightq error."""
    try:
        call()
    except fl.FlightError as e:
        info = getattr(e, "extra_info", None)
        assert info, f"untyped server error: {type(e).__name__}: {e}"
        kind = msgpack.unpackb(info)["type"]
        assert kind in ERROR_CLASSES, kind


def _alive(location: str) -> None:
    with fl.connect(location) as c:
        (res,) = list(c.do_action(fl.Action("health", b"")))
        assert msgpack.unpackb(res.body.to_pybytes())["ok"] is True


OPTIONS = fl.FlightCallOptions(timeout=20)


@FUZZ
@given(ticket=_TICKETS)
def test_random_tickets_give_typed_errors_and_the_server_serves_on(fuzz_server, ticket):
    with fl.connect(fuzz_server.location) as c:
        _typed_or_ok(lambda: c.do_get(fl.Ticket(ticket), options=OPTIONS).read_all())
    _alive(fuzz_server.location)


@FUZZ
@given(
    kind=st.sampled_from([*ACTIONS, "frob"]) | st.text(max_size=8),
    body=st.one_of(
        st.binary(max_size=64),
        st.builds(
            lambda d: msgpack.packb(d, use_bin_type=True),
            st.dictionaries(
                st.sampled_from(["partition", "keys", "task", "schema", "tasks", "name"]),
                st.sampled_from(["p", "nope", "train"]) | _ANY,
                max_size=4,
            ),
        ),
    ),
)
def test_random_actions_give_typed_errors_and_the_server_serves_on(fuzz_server, kind, body):
    if kind in ("drop", "clear") and b"p" in body:
        kind = "describe"  # keep partition 'p' for the other examples
    with fl.connect(fuzz_server.location) as c:
        _typed_or_ok(lambda: list(c.do_action(fl.Action(kind, body), options=OPTIONS)))
    _alive(fuzz_server.location)


@FUZZ
@given(
    command=_TICKETS,
    # Paths are protobuf strings: invalid UTF-8 is refused by gRPC before flightq sees it.
    path=st.lists(st.text(max_size=8), min_size=0, max_size=2),
)
def test_random_descriptors_give_typed_errors_and_the_server_serves_on(fuzz_server, command, path):
    batch = text_batch(["fz"])
    with fl.connect(fuzz_server.location) as c:
        for d in (fl.FlightDescriptor.for_command(command), fl.FlightDescriptor.for_path(*path)):
            _typed_or_ok(lambda d=d: c.get_flight_info(d, options=OPTIONS))

            def put(d: fl.FlightDescriptor = d) -> None:
                writer, reader = c.do_put(d, batch.schema, options=OPTIONS)
                with writer:
                    writer.write_batch(batch)
                    writer.done_writing()
                    reader.read()

            _typed_or_ok(put)
    _alive(fuzz_server.location)


_PUT_COMMANDS = st.fixed_dictionaries(
    {"partition": st.sampled_from(["p", "nope"]) | _ANY},
    optional={
        "rows": st.integers(-1, 3) | _ANY,
        "put_id": st.text(max_size=4) | _ANY,
        "overwrite": _ANY,
        "timeout": st.floats(0, 0.02) | _ANY,
    },
)


@FUZZ
@given(command=_PUT_COMMANDS, key=st.sampled_from(["k0", "fz", "fy"]))
def test_random_put_commands_give_typed_errors_and_the_server_serves_on(fuzz_server, command, key):
    partition = command.pop("partition")
    batch = text_batch([key])
    if not isinstance(partition, str):
        command["partition"] = partition
        partition = "p"
    descriptor = fl.FlightDescriptor.for_command(
        msgpack.packb({"partition": partition, **command}, use_bin_type=True)
    )
    with fl.connect(fuzz_server.location) as c:

        def put() -> None:
            writer, reader = c.do_put(descriptor, batch.schema, options=OPTIONS)
            with writer:
                writer.write_batch(batch)
                writer.done_writing()
                reader.read()

        _typed_or_ok(put)
    _alive(fuzz_server.location)
