"""A put's answer: the acknowledgement, then what the put created.

The acknowledgement (``PutAck``, ``{"rows": n}``) is the DoPut stream's first metadata
message, as it always was, so a client that reads only that one (an older client, a
plain Flight one) still parses it; the creation record (``PutCreated``) follows as a
message of its own. A put's receipt carries it, whichever way the put travelled.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
from fixtures_dataplane import TEXT
from helpers_reliability import put_command, text_batch

import flightq
from flightq.protocol import PutAck, PutCreated


def _answers(location: str, descriptor: fl.FlightDescriptor, rb: pa.RecordBatch) -> list[Any]:
    """Every metadata message a DoPut of ``rb`` is answered with, decoded."""
    out = []
    with fl.connect(location) as c:
        writer, reader = c.do_put(descriptor, rb.schema)
        with writer:
            writer.write_batch(rb)
            writer.done_writing()
            while (m := reader.read()) is not None:
                out.append(msgpack.unpackb(m.to_pybytes()))
    return out


def test_a_doput_is_acknowledged_first_then_told_what_it_created(
    server: flightq.Server, client: flightq.Client
) -> None:
    client.create_partition("p", TEXT)
    rb = text_batch(["a", "b"])
    put = put_command("p", rows=2, put_id="x")
    first = _answers(server.location, put, rb)
    assert first == [{"rows": 2}, {"created": 2, "groups": [0, 2]}]
    assert PutAck.parse(msgpack.packb(first[0])) == PutAck(rows=2)  # as older clients read it
    assert _answers(server.location, put, rb) == [{"rows": 2}, {"created": 0, "replay": True}]


def test_a_receipt_says_what_the_put_created(client: flightq.Client) -> None:
    client.create_partition("p", TEXT, group_size=2)
    keys = ["a_g0", "a_g1"]
    ids = [np.arange(3, dtype=np.int64)] * 2
    r = client.put("p", keys, {"input_ids": ids}, put_id="x")
    assert (r.created, r.creation) == (2, PutCreated(created=2, groups=[0, 1]))
    again = client.put("p", keys, {"input_ids": ids}, put_id="x")
    assert (int(again), again.created, again.creation.replay) == (2, 0, True)
    lp = [np.zeros(3, dtype=np.float32)] * 2
    back = client.put("p", keys, {"prev_logprobs": lp})  # columns on existing rows
    assert (int(back), back.created, back.creation.replay) == (2, 0, False)
