"""Where a fresh step's get over the socket spends its time, against bare Flight.

Three reads of the same step, each of a copy of it put afresh that round (as in ``flightq
bench``, every timed read is the first of what it reads), interleaved, their order
reversed every other round:

- ``bare``: the benchmark's bare Flight server (``bare-flight-records``) holding the record
  batches a flightq put of the step sends, read with a plain DoGet and ``read_all``;
- ``server``: a plain DoGet of flightq's own get ticket against ``flightq serve`` (a
  partition of its own), read with ``read_all``: flightq's server answering, nothing of
  flightq's client;
- ``client``: ``Client.get`` of every row from another partition of the same server,
  then what the reader takes (``--form``:
  ``packed``, token and tensor columns as ``.packed()`` and the rest as ``batch[name]``;
  ``rows``, every field's per-row tensors);
- ``floor`` (``--form packed`` only): bare Flight's records of a second copy of the step,
  then the least a reader must do to hand out what ``client`` hands out, safely
  (:func:`floor_taken`: Arrow's full validation, unique keys, each distinct tags value
  decoded, every token and tensor column's row shapes held to its payload lengths, the
  token columns to one another; flat views, int32 offsets, scalar tensors). What a
  flightq get could come down to with nothing of its own but those checks.

With the floor, two more timings per round, of the work after the receive alone: ``floor
checks`` (:func:`floor_taken` on bare Flight's records just read) and ``client decode``
(what ``Client.get`` does with flightq's answer just read by a plain DoGet: validate,
decode, check the tags, then what the reader takes and every row's tags), each timed
right after its own DoGet, their order reversed every other round.

Both servers run on 127.0.0.1 in processes of their own; the client's answer is checked
against the step once before anything is timed. Prints each read's median ms and the
paired ratios per round (median [p10-p90]): bare / server (what flightq's server adds to
the transport), server / client (what flightq's client adds) and bare / client (flightq
against bare Flight's records, the W3 target's ratio); with the floor, bare / floor (what
the least checks and columns cost), floor / client (flightq against that floor) and
floor checks / client decode (flightq's decode against the floor's checks, transfers left
out).

Run::

    .venv/bin/python benchmarks/get_parts.py --workload W3 --form packed --rounds 40
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from flightq_bench.flightq_system import packed_taken, server_argv
from flightq_bench.procs import ServerProcess

__all__ = ["DECODES", "FORMS", "READS", "floor_taken", "main", "measure", "reads"]

FORMS = ("packed", "rows")
READS = ("bare", "floor", "server", "client")
#: The timings of the work after a receive alone (``--form packed``, beside the floor).
DECODES = ("floor checks", "client decode")


def reads(form: str) -> tuple[str, ...]:
    """The reads a run of ``form`` times (the floor only hands out packed columns)."""
    return READS if form == "packed" else tuple(r for r in READS if r != "floor")


def floor_taken(table: Any, schema: Any) -> tuple[list[str], list[dict[str, Any]], dict[str, Any]]:
    """The least a reader does to hand out what a packed reader of ``Client.get`` takes,
    from bare Flight's records of a step (one record batch): its keys, each row's tags
    and per field a ``flightq.Packed`` of a token or tensor column (flat view, int32
    offsets) or a scalar column's tensor.

    Checked on the way, as any reader that trusts no sender must: Arrow's full
    validation (offsets inside their buffers), no null, unique keys, each distinct tags
    value a msgpack map, every token and tensor row one-dimensional with a payload of
    exactly its shape's bytes, the token columns of a row of one length.

    Raises
    ------
    ValueError
        If any check fails, or the step is not one record batch of such columns.
    """
    import msgpack
    import numpy as np
    import pyarrow as pa
    import torch

    from flightq import Packed

    batches = table.to_batches()
    if len(batches) != 1:
        raise ValueError(f"the floor reads a step of one record batch, got {len(batches)}")
    rb = batches[0]
    rb.validate(full=True)
    keys = rb.column(0).to_pylist()
    if len(set(keys)) != len(keys) or None in keys:
        raise ValueError("row keys are not unique")
    seen: dict[bytes, int] = {}
    picks = [seen.setdefault(b, len(seen)) for b in rb.column(1).to_pylist()]
    maps = [{} if b is None else msgpack.unpackb(b, raw=False) for b in seen]
    if not all(isinstance(m, dict) for m in maps):
        raise ValueError("a row's tags are not a map")
    names = rb.schema.names
    out: dict[str, Any] = {}
    seq = None
    for name in names[2:]:
        if name.endswith("__shape"):
            continue
        col = rb.column(name)
        f = schema[name]
        if col.null_count:
            raise ValueError(f"{name}: null rows")
        if f.role == "scalar":
            out[name] = torch.from_numpy(col.to_numpy(zero_copy_only=False))
            continue
        if f.role not in ("token", "tensor") or not f.dt.native_numpy:
            raise ValueError(
                f"{name}: the floor takes token, tensor and scalar fields of numpy dtypes"
            )
        if not pa.types.is_large_binary(col.type):
            raise ValueError(f"{name}: payloads are {col.type}, not large_binary")
        shapes = rb.column(name + "__shape")
        so, sv = shapes.offsets.to_numpy(), shapes.values.to_numpy()
        if shapes.null_count or (np.diff(so) != 1).any():
            raise ValueError(f"{name}: a row is not one-dimensional")
        dims = sv[so[0] : so[-1]]
        bufs = col.buffers()
        offs = np.frombuffer(bufs[1], dtype=np.int64, count=len(col) + 1, offset=8 * col.offset)
        item = f.dt.itemsize
        if not np.array_equal(np.diff(offs), dims * item):
            raise ValueError(f"{name}: a payload is not its shape's bytes")
        if f.role == "token":
            if seq is None:
                seq = dims
            elif not np.array_equal(seq, dims):
                raise ValueError(f"{name}: token columns differ in length")
        flat = np.frombuffer(
            bufs[2], dtype=f.dt.storage, count=int(dims.sum()), offset=int(offs[0])
        )
        starts = ((offs - offs[0]) // item).astype(np.int32)
        out[name] = Packed(torch.from_numpy(flat), torch.from_numpy(starts), int(dims.max()))
    return keys, [dict(maps[j]) for j in picks], out


def _taken(batch: Any, form: str) -> dict[str, Any]:
    """What a reader takes from the answer (``form``: see the module's text)."""
    if form == "rows":
        return {f: batch[f] for f in batch.fields}
    return packed_taken(batch)


def _check(step: Any, batch: Any, form: str) -> None:
    """The client's answer against the step, bit for bit (packed columns cut into rows)."""
    from flightq_bench.payload import check_rows, unpacked

    check_rows(step, list(batch.keys), unpacked(_taken(batch, form)), batch.tags, f"get ({form})")


def measure(workload: str = "W3", form: str = "packed", rounds: int = 40) -> dict[str, list[float]]:
    """Per read (:data:`READS`), the seconds of each of ``rounds`` timed reads; with the
    floor, also per :data:`DECODES` the seconds of the work after each round's receive."""
    import pyarrow as pa
    import pyarrow.flight as fl

    import flightq
    from flightq.batch import PartDecoder, join
    from flightq.chunks import encode_chunks
    from flightq.client.client import DEFAULT_MAX_BATCH_BYTES
    from flightq.protocol import GetTicket
    from flightq.registry import SchemaRegistry
    from flightq.workloads import make, to_torch

    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    timed = reads(form)
    # The floor views read-only received buffers as tensors, as flightq's client does;
    # torch warns of that once a process (flightq silences it the same way).
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    ref = make(workload)  # numpy: what the answer is checked against
    step = to_torch(ref)  # torch: what a producer puts
    schema = SchemaRegistry.default().get(step.schema)
    # What a put sends (encoded before the timer, as bare-flight-records does).
    table = pa.Table.from_batches(
        encode_chunks(schema, step.columns, step.keys, step.tags, max_bytes=DEFAULT_MAX_BATCH_BYTES)
    )
    bare_argv = [sys.executable, "-m", "flightq_bench.arrowflight"]
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerProcess(server_argv(), "flightq"))
        bare = stack.enter_context(ServerProcess(bare_argv, "bare Flight"))
        c = stack.enter_context(flightq.connect(server.info["listening"], [schema], timeout=60))
        plain = stack.enter_context(fl.connect(server.info["listening"]))
        held = stack.enter_context(fl.connect(bare.info["listening"]))
        for name in ("p", "q"):  # read by the client, read by a plain DoGet
            c.create_partition(name, schema, tasks=["train"], group_size=step.group_size)
        ticket = fl.Ticket(GetTicket(partition="q", keys=list(step.keys)).to_wire())

        def put() -> None:
            for name in ("p", "q"):
                c.put(name, step.keys, step.columns, tags=step.tags)
            for path in ("s", "f") if "floor" in timed else ("s",):  # bare, floor
                writer, reader = held.do_put(fl.FlightDescriptor.for_path(path), table.schema)
                writer.write_table(table)
                writer.done_writing()
                reader.read()
                writer.close()

        def read(which: str) -> Any:
            if which == "bare":
                return held.do_get(fl.Ticket(b"s")).read_all()
            if which == "floor":
                return floor_taken(held.do_get(fl.Ticket(b"f")).read_all(), schema)
            if which == "server":
                return plain.do_get(ticket).read_all()
            batch = c.get("p", step.keys)
            return batch, _taken(batch, form)

        def after_receive(which: str) -> float:
            """Seconds of the work after a receive: the floor's, or what Client.get does
            (a decoder as its reads use, then the reader's columns and rows' tags)."""
            if which == "floor checks":
                got = held.do_get(fl.Ticket(b"f")).read_all()
                t0 = time.perf_counter()
                floor_taken(got, schema)
                return time.perf_counter() - t0
            batches = plain.do_get(ticket).read_all().to_batches()
            t0 = time.perf_counter()
            d = PartDecoder("torch", False)
            for b in batches:
                d.add(b)
            batch = join(d.parts)
            _taken(batch, form)
            _ = batch.tags
            return time.perf_counter() - t0

        put()
        _check(ref, read("client")[0], form)  # once, before anything is timed
        if "floor" in timed:
            from flightq_bench.payload import check_rows, unpacked

            keys, tags, cols = read("floor")
            check_rows(ref, keys, unpacked(cols), tags, "floor")
        for which in ("bare", "server"):  # each connection's first call, untimed too
            if read(which).num_rows != len(step.keys):
                raise AssertionError(f"{which}: not every row of the step came back")
        for name in ("p", "q"):
            c.clear(name)
        decodes = DECODES if "floor" in timed else ()
        out: dict[str, list[float]] = {k: [] for k in (*timed, *decodes)}
        for r in range(rounds):
            put()
            for which in timed if r % 2 == 0 else timed[::-1]:
                t0 = time.perf_counter()
                read(which)
                out[which].append(time.perf_counter() - t0)
            for which in decodes if r % 2 == 0 else decodes[::-1]:
                out[which].append(after_receive(which))
            for name in ("p", "q"):
                c.clear(name)
        return out


def _ratio(a: list[float], b: list[float]) -> str:
    """``a``'s time over ``b``'s, paired per round: median [p10-p90]; it reads as ``b``'s
    speed against ``a``'s (below 1x: ``b`` is slower)."""
    r = sorted(x / y for x, y in zip(a, b, strict=True))
    n = len(r)
    return f"{statistics.median(r):.2f}x [{r[n // 10]:.2f}-{r[(9 * n) // 10]:.2f}]"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W3")
    p.add_argument("--form", default="packed", choices=FORMS)
    p.add_argument("--rounds", type=int, default=40)
    a = p.parse_args(argv)
    got = measure(a.workload, a.form, a.rounds)
    print(f"{a.workload} get over the socket ({a.form}), each a fresh step's first: median ms")
    for k in got:
        print(f"  {k:<13} {statistics.median(got[k]) * 1e3:8.2f}")
    print(f"  bare / server   {_ratio(got['bare'], got['server'])}   (flightq's server)")
    print(f"  server / client {_ratio(got['server'], got['client'])}   (flightq's client)")
    print(f"  bare / client   {_ratio(got['bare'], got['client'])}   (flightq against bare)")
    if "floor" in got:
        print(f"  bare / floor    {_ratio(got['bare'], got['floor'])}   (the least checks)")
        print(
            f"  floor / client  {_ratio(got['floor'], got['client'])}   (flightq against the floor)"
        )
        print(
            f"  floor checks / client decode {_ratio(got['floor checks'], got['client decode'])}"
            "   (the work after the receive alone)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
