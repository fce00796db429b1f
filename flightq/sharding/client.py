"""A client over a partition spread across several flightq servers (shards).

:func:`connect_sharded` gives a :class:`ShardedClient` with the methods of
:class:`flightq.Client`. Rows are routed by :class:`flightq.sharding.router.Router` (rendezvous
hashing of the group prefix, so a prompt group stays on one shard). A put is split by
shard and written to the shards in parallel, one atomic DoPut each; a get fans out and
comes back in the order asked; a claim gathers whole groups from the shards in rotating
order. Every error names the shard it came from. Semantics: ``docs/sharding.md``.

Examples
--------
>>> import flightq, numpy as np
>>> with flightq.Server() as a, flightq.Server() as b:
...     c = flightq.connect_sharded([a.location, b.location], ["rollout_text@1"])
...     c.create_partition("rollouts", "rollout_text@1", tasks=["train"])
...     keys = [f"p{p}_g{i}" for p in range(4) for i in range(2)]
...     c.put("rollouts", keys, {"input_ids": [np.arange(3)] * 8})
...     c.get("rollouts", keys[::-1], as_="numpy").keys == keys[::-1]
...     c.close()
True
8
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..batch import Batch, Claim, Received, check_as, decode
from ..chunks import encode_chunks
from ..client.client import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_TIMEOUT,
    SCHEMA_FAULTS,
    redeclared,
    resolve_schemas,
    same_protocol,
)
from ..client.interface import PutReceipt
from ..client.reads import bounded, claimed, granted, in_order
from ..cuda import decode_to_device, resolve_device
from ..errors import (
    ClaimTimeoutError,
    FlightqError,
    FlightqTimeoutError,
    LeaseExpiredError,
    NotFoundError,
    ProtocolError,
    SchemaMismatchError,
    UnavailableError,
)
from ..msgcheck import key_chunks
from ..protocol import ClaimGrant, ClaimTicket, Clear, GetTicket, Nack, PutCreated
from ..registry import SchemaRegistry
from ..rows import columns_of
from ..schema import Schema
from ..tensordicts import tensordict_reads
from .fanout import DEFAULT_POLL, Fanout, at_shard
from .router import (
    gather,
    group_key,
    keys_of,
    merge,
    runs,
    sequential,
    spans,
)

__all__ = ["ShardedClient", "connect_sharded"]

#: Seconds a claim's call to one shard may take past the shard's own wait.
_MARGIN_S = 5.0
#: Seconds a shard that left a claim unanswered is asked last by the claims after it.
SLOW_SHARD_S = 30.0


def connect_sharded(
    locations: Sequence[str],
    schemas: Iterable[str | Schema] = (),
    *,
    registry: SchemaRegistry | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    key_fn: Callable[[str], str] = group_key,
    poll: float = DEFAULT_POLL,
    **flight_kwargs: Any,
) -> ShardedClient:
    """Connect to every shard and check the schema versions on each, in parallel.

    Parameters
    ----------
    locations:
        Every shard's ``grpc://host:port``; the same strings in every process (they are
        the shards' identity in routing; their order does not matter).
    schemas, registry, timeout, max_batch_bytes:
        As in :func:`flightq.connect`.
    key_fn:
        Row key to routing key (:func:`flightq.sharding.router.group_key`: the group prefix).
    poll:
        Seconds a claim waits on one shard before looking at the others again.

    Returns
    -------
    ShardedClient

    Raises
    ------
    UnavailableError
        Naming each shard that cannot be reached.
    SchemaMismatchError, UnknownSchemaError
        Naming the shard whose schema differs.
    ProtocolError
        Naming a shard that speaks another protocol version.

    Examples
    --------
    >>> c = flightq.connect_sharded(["grpc://node1:8815", "grpc://node2:8815"],
    ...                             ["rollout_vlm@1"])  # doctest: +SKIP
    """
    client = ShardedClient(
        locations,
        timeout=timeout,
        max_batch_bytes=max_batch_bytes,
        key_fn=key_fn,
        poll=poll,
        **flight_kwargs,
    )
    try:
        for where, health in client.health()["shards"].items():
            same_protocol(health, f"{where} (a shard)")
        wanted = resolve_schemas(schemas, registry)
        if wanted:
            client.check_schemas(wanted)
    except BaseException:
        client.close()
        raise
    return client


class ShardedClient(Fanout):
    """Partitions spread over several flightq servers. Thread-safe; one per process.

    Prefer :func:`connect_sharded`, which also checks every shard's schemas. Control
    calls (``create_partition``, ``clear``, ``reset``, ``drop``, ``stats``, ``inspect``,
    ``describe``, ``partitions``, ``health``, ...) come from
    :class:`~flightq.sharding.fanout.Fanout`.
    """

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        columns: Mapping[str, Any],
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        overwrite: bool = False,
        timeout: float | None = None,
        put_id: str | None = None,
    ) -> PutReceipt:
        """Write rows, split by shard, to the shards in parallel. Returns the rows written.

        The count is a :class:`~flightq.PutReceipt` naming the shards written to
        (``shards``) and the route the parts took. ``put_id`` names each shard's part (the
        same id on every shard): a retry of the put is acknowledged again by the shards
        that stored their part, and stored by the others (a shard that rolled its part
        back, below, forgets the id).

        Each shard's part is one atomic DoPut. If a part fails, the rows this put created
        on the other shards, as each shard says in its acknowledgement, are cleared again,
        so a put that creates rows (a generator's) is all or nothing. Nothing else is
        cleared: a shard that acknowledged its part as a replay (a retry of a put it had
        stored) keeps those acknowledged rows, columns a write-back added to existing rows
        stay, and a shard whose server does not say what the put created (an older one)
        is left as it is. The error says what each shard holds and how to retry.

        Raises
        ------
        ShapeError
            If ``group_size`` consecutive rows of a grouped partition do not share a
            routing key (a group would be split over shards).
        UnavailableError, and every error of :meth:`flightq.Client.put`
            Naming the shard that failed and what was rolled back. Refused by its own
            encode (nothing sent), the put describes the partition again and, where
            another client declared it anew since (another schema or group size), goes
            once more under that; refused by the shards for its schema
            (``SchemaMismatchError``), it forgets the declaration it kept, so that the
            next put goes under the new one.
        """
        schema, g = self._decl(partition)
        ks = list(keys)
        tg = None if tags is None else list(tags)
        try:
            parts = self._encode(partition, schema, g, ks, columns, tg)
        except SCHEMA_FAULTS as refused:
            # Refused by the local encode, before anything was sent: where the kept
            # declaration is stale (the partition declared again), once more with it fresh.
            fresh = redeclared(refused, lambda: self._decl_changed(partition, (schema, g)))
            parts = self._encode(partition, *fresh, ks, columns, tg)
        try:
            return self._put_parts(partition, parts, overwrite, timeout, put_id)
        except SchemaMismatchError:
            self._decls.pop(partition)  # the next put describes the partition afresh
            raise

    def _encode(
        self,
        partition: str,
        schema: Schema,
        g: int | None,
        ks: list[str],
        columns: Mapping[str, Any],
        tg: list[Mapping[str, Any] | None] | None,
    ) -> dict[int, list[pa.RecordBatch]]:
        """Each shard's record batches of a put encoded for ``schema``."""
        columns = columns_of(columns, schema, ks)  # a TensorDict, nested tensors: per row
        self.router.check_groups(ks, g, f"put to {partition!r}")
        # Each shard's rows are encoded on their own, so a part carries only its own media.
        return {
            s: [
                b
                for lo, hi in spans(pos)
                for b in encode_chunks(
                    schema,
                    {name: _rows(v, lo, hi) for name, v in columns.items()},
                    ks[lo:hi],
                    None if tg is None else tg[lo:hi],
                    max_bytes=self._clients[s].max_batch_bytes,
                )
            ]
            for s, pos in self.router.split(ks).items()
        }

    def put_batch(
        self,
        partition: str,
        batch: pa.RecordBatch | Sequence[pa.RecordBatch],
        *,
        overwrite: bool = False,
        timeout: float | None = None,
        put_id: str | None = None,
    ) -> PutReceipt:
        """Write already encoded record batches, split by shard (see :meth:`put`).

        Each shard gets zero-copy slices of the batches, as one put; a media column's
        dictionary is its whole batch's, so a shard also receives the media of rows it
        does not hold: prefer :meth:`put` for media.
        """
        _, g = self._decl(partition)
        batches = [batch] if isinstance(batch, pa.RecordBatch) else list(batch)
        keys = keys_of(batches)
        self.router.check_groups(keys, g, f"put to {partition!r}")
        parts: dict[int, list[pa.RecordBatch]] = {}
        for b in batches:
            for s, pos in self.router.split(keys_of([b])).items():
                parts.setdefault(s, []).extend(runs(b, pos))
        return self._put_parts(partition, parts, overwrite, timeout, put_id)

    def _put_parts(
        self,
        partition: str,
        parts: Mapping[int, list[pa.RecordBatch]],
        overwrite: bool,
        timeout: float | None,
        put_id: str | None,
    ) -> PutReceipt:
        """Each shard's batches as one DoPut, in parallel; roll back if any part fails."""
        calls = {
            s: (
                lambda c, bs=bs: c.put_batch(
                    partition, bs, overwrite=overwrite, timeout=timeout, put_id=put_id
                )
            )
            for s, bs in parts.items()
        }
        done, failed = self._run(calls)
        if failed:
            note = (
                ""
                if len(parts) == 1
                else self._roll_back(partition, parts, done, overwrite, put_id)
            )
            raise self._error(failed, note) from failed[0][1]
        routes = sorted({r.route for r in done.values()})
        shards = [self.locations[s] for s in sorted(done)]
        return PutReceipt(sum(done.values()), "+".join(routes), shards, _summed(done.values()))

    def _roll_back(
        self,
        partition: str,
        parts: Mapping[int, list[pa.RecordBatch]],
        done: Mapping[int, PutReceipt],
        overwrite: bool,
        put_id: str | None,
    ) -> str:
        """Clear the rows a failed put created on the shards whose part succeeded, and
        say what each of them holds now and how to complete the put.

        Only the rows a shard says this put created go (its
        :class:`~flightq.protocol.PutCreated`), by a clear that removes those rows and no
        other (``groups``): a shard that acknowledged the part as a replay of an earlier
        put created none, so the rows of that acknowledged put stay; rows that existed
        before keep what the put wrote. Where a shard did not say (a server older than
        that record), nothing is cleared there: deleting rows it cannot prove this put
        created could delete acknowledged ones. Each shard that rolls back forgets
        ``put_id`` in the same step, so a retry of the put by its ``put_id`` stores the
        rows there again instead of being acknowledged as a replay.
        """
        if not done:
            return f"nothing of the put to {partition!r} was stored"
        lines: list[str] = []
        remains = False  # a shard holds this put's part (from this attempt or an earlier one)
        columns = False  # ... and rows it added columns to, which a retry rewrites
        for s, receipt in done.items():
            n = len(keys_of(parts[s]))
            where = f"shard {self.locations[s]}"
            made = receipt.creation
            if made is None:
                remains = True
                lines.append(
                    f"{where} did not say which of its {n} rows this put created (its server "
                    "predates put creation records): nothing rolled back there, so they hold "
                    "what this put or an earlier one wrote"
                )
                continue
            if made.replay:
                remains = True
                lines.append(
                    f"{where} had stored this part before (acknowledged again as a replay): "
                    f"its {n} rows stay as they were"
                )
                continue
            kept = n - made.created
            if made.groups is not None:
                keys = keys_of(parts[s])
                try:
                    cleared = 0
                    for chunk in key_chunks(keys):  # each within what a message carries
                        clear = Clear(
                            partition=partition, keys=chunk, put_id=put_id, groups=made.groups
                        )
                        cleared += self.transports[s].action(clear).cleared
                    gone = made.created - cleared
                    lines.append(
                        f"rolled back {cleared} new rows on {where}"
                        + (f" ({gone} more it created were cleared meanwhile)" if gone else "")
                    )
                except FlightqError as e:
                    remains = True
                    lines.append(f"could not roll back {made.created} new rows on {where}: {e}")
            if kept:
                remains = True
                columns = columns or not overwrite
                lines.append(f"{kept} existing rows on {where} keep what this put wrote")
        if remains:
            lines.append(
                "the put is not whole: retry it once every shard answers, with the same "
                "put_id or the same content"
                + (", and overwrite=True" if columns else "")
                + ": a shard that holds its part acknowledges it again"
            )
        return "; ".join(lines)

    @tensordict_reads
    def get(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        as_: str = "torch",
        copy: bool = False,
        timeout: float | None = None,
        device: Any = None,
        sync: bool = True,
        hide_tag_values: str | None = None,
    ) -> Batch:
        """Rows by key from their shards, in parallel, in the order asked.

        ``device`` and ``sync`` as for :meth:`flightq.Client.get`: the shards' answers
        are read, then decoded into CUDA tensors together; ``hide_tag_values`` too.

        Raises
        ------
        UnavailableError
            Naming the shard that cannot be reached, when any asked row lives there; rows
            on healthy shards stay readable by asking for them alone.
        NotFoundError, MissingFieldError
            As :meth:`flightq.Client.get`, naming the shard.
        """
        dev = resolve_device(device, as_)
        ks = list(keys)
        parts = self.router.split(ks) if ks else {0: []}
        f = None if fields is None else list(fields)
        what = f"get from {partition!r}"

        def one(s: int, pos: list[int]) -> Callable[[Any], list[pa.RecordBatch]]:
            t = GetTicket(
                partition=partition,
                keys=[ks[i] for i in pos],
                fields=f,
                hide_tag_values=hide_tag_values,
            )

            def read(_: Any) -> list[pa.RecordBatch]:
                # Held to what was asked of the shard, as a Client's get is: a stream
                # past its keys refused at that batch, its rows its keys in order.
                got = self.transports[s].get(t, what, timeout=timeout)
                bs = list(bounded(got, len(t.keys), what))
                in_order(t.keys, keys_of(bs), what)
                return bs

            return read

        started = time.perf_counter()
        res = self._fan({s: one(s, pos) for s, pos in parts.items()})
        merged = merge(len(ks), [(pos, res[s]) for s, pos in parts.items()])
        return self._decoded(merged, started, as_, copy, dev, sync)

    def _decoded(
        self,
        merged: list[pa.RecordBatch],
        started: float,
        as_: str,
        copy: bool,
        device: Any,
        sync: bool,
    ) -> Batch:
        """The shards' merged answer decoded (into ``device`` when given), saying how it
        arrived."""
        if device is not None:
            batch: Batch = decode_to_device(merged, device, self.pinned, copy=copy, sync=sync)
            route = "device"
        else:
            batch, route = decode(merged, as_=as_, copy=copy), "socket"
        now = time.perf_counter()
        batch.received = Received(len(merged), now, now - started, route)
        return batch

    @tensordict_reads
    def claim(
        self,
        partition: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        *,
        wait_for: Sequence[str] = (),
        timeout: float | None = None,
        as_: str = "torch",
        copy: bool = False,
        device: Any = None,
        sync: bool = True,
        lease: float | None = None,
        call_id: str | None = None,
        hide_tag_values: str | None = None,
    ) -> Batch:
        """Take ``batch_size`` ready rows for ``task``, whole groups, from one or more shards.

        Starting at a shard that rotates from call to call, each shard gives what it has
        ready (the largest whole number of groups not above what is still needed, found
        by halving), until ``batch_size`` rows are gathered, or a shard answers short
        with the rest of a group acked in part, which ends the claim there. When no
        shard has any, the claim waits on one shard for ``poll`` seconds, then looks at
        all again, until ``timeout``. Rows of one group always come from one shard; rows
        of one shard come in its creation order, shards in the order they answered. A
        shard that cannot be reached is skipped while the others have enough rows; once
        they do not, the claim fails at once with ``UnavailableError``. ``call_id`` names
        the claim on every shard, for :meth:`cancel_claim` (one of the client's own where
        None: closing the client stops the claim either way).

        Raises
        ------
        ClaimCancelledError
            If :meth:`cancel_claim` named ``call_id``; rows gathered meanwhile are given
            back.
        ClaimTimeoutError
            If not enough rows become ready within ``timeout``; rows gathered meanwhile
            are made claimable again first.
        UnavailableError
            Naming a shard that cannot be reached, when the others lack rows (gathered
            rows are given back).
        DeviceError
            If ``device`` cannot be used here; nothing is claimed.
        """
        dev = resolve_device(device, as_)
        if dev is None:
            check_as(as_)
        wait = self.timeout if timeout is None else timeout
        _, g = self._decl(partition)
        unit = g or 1
        if batch_size < 1 or batch_size % unit:
            raise ProtocolError(
                f"claim from {partition!r}: batch_size {batch_size} must be >= 1"
                + (f" and a multiple of the group size {g}" if g else "")
            )
        n = len(self._clients)
        start = next(self._turn) % n
        call = uuid.uuid4().hex if call_id is None else call_id  # closing stops it (Client.claim)
        got: list[tuple[int, list[pa.RecordBatch]]] = []
        grants: list[tuple[int, ClaimGrant, list[str]]] = []
        f, w = None if fields is None else list(fields), list(wait_for)
        what = f"claim from {partition!r}"
        started = time.perf_counter()

        down: dict[int, UnavailableError] = {}
        taken: set[str] = set()  # the rows the claim's shards gave so far

        def give_back(s: int, grant: ClaimGrant) -> None:
            with contextlib.suppress(FlightqError):  # a shard that is gone ends it too
                self._clients[s].transport.action(Nack(partition=partition, claim=grant.claim))

        def read(s: int, t: ClaimTicket, secs: float) -> list[pa.RecordBatch]:
            # Held to what was asked, as a Client's claim is. An answer refused or broken
            # after its grant came (its rows were taken) has them given back at once,
            # whether the claim fails or goes on with the other shards; only an answer
            # taken whole joins `grants`.
            grant: list[ClaimGrant] = []
            # The shard answers within `secs`; the call's deadline, a margin on top, also
            # bounds the answer's transfer (a large one over a slow link), so it is not
            # cut to the claim's own deadline: a shard that does not answer at all
            # (stopped) holds a claim up to the margin past its wait, once, and is then
            # asked last (SLOW_SHARD_S).
            got = self.transports[s].get(t, what, timeout=secs + _MARGIN_S)
            try:
                bs = list(bounded(granted(got, grant, what), t.batch_size, what))
                if not grant:
                    raise ProtocolError(f"{what}: the claim's answer carries no rows")
                ks = keys_of(bs)
                claimed(ks, grant[0].deliveries, t.batch_size, what, taken)
            except BaseException:
                if grant:
                    give_back(s, grant[0])
                raise
            grants.append((s, grant[0], ks))
            taken.update(ks)
            return bs

        def take(s: int, size: int, secs: float) -> int:
            if s in down:
                return 0
            try:
                t = ClaimTicket(
                    partition=partition,
                    task=task,
                    batch_size=size,
                    timeout=secs,
                    fields=f,
                    wait_for=w,
                    lease=lease,
                    session=self._clients[s].session.id(),
                    call=call,
                    hide_tag_values=hide_tag_values,
                )
                try:
                    bs = read(s, t, secs)
                except NotFoundError as e:
                    if e.key is None or e.key != t.session:
                        raise
                    # The shard no longer knows the session (it restarted): open another.
                    fresh = self._clients[s].session.reopen(e.key)
                    t = dataclasses.replace(t, session=fresh)
                    bs = read(s, t, secs)
            except ClaimTimeoutError:
                return 0
            except UnavailableError as e:
                down[s] = e  # the other shards may still have enough
                return 0
            except FlightqTimeoutError as e:  # no answer in time: as one that is down
                down[s] = UnavailableError(f"{e} (the shard did not answer in time)")
                self._slow_until[s] = time.monotonic() + SLOW_SHARD_S
                return 0
            except FlightqError as e:
                raise at_shard(self.locations[s], e) from e
            got.append((s, bs))
            return sum(b.num_rows for b in bs)

        def after_sweep(missing: int) -> None:
            if down:
                s, e = next(iter(down.items()))
                raise UnavailableError(
                    f"shard {self.locations[s]}: {e}; the other shards had "
                    f"{batch_size - missing} of the {batch_size} rows asked (given back)"
                ) from e

        try:
            order = [(start + i) % n for i in range(n)]
            now = time.monotonic()
            order.sort(key=lambda s: self._slow_until[s] > now)  # stable: those last
            deadline = time.monotonic() + wait
            with contextlib.ExitStack() as named:  # closing the client stops the claim
                for c in self._clients:
                    named.enter_context(c.named.held(partition, call))
                missing = gather(order, batch_size, unit, take, deadline, self.poll, after_sweep)
            if missing:
                raise ClaimTimeoutError(
                    f"claim of {batch_size} rows for task {task!r} from partition "
                    f"{partition!r} over {n} shards timed out after {wait:g}s: "
                    f"{batch_size - missing} rows were ready (given back)"
                )
            merged = merge(sum(b.num_rows for _, bs in got for b in bs), sequential(got))
            batch = self._decoded(merged, started, as_, copy, dev, sync)
        except BaseException:
            for s, grant, _ in grants:
                give_back(s, grant)
            raise
        now = time.monotonic()
        parts = tuple(
            Claim(
                partition,
                task,
                gr.claim,
                tuple(ks),
                tuple(gr.deliveries),
                gr.lease,
                now + gr.lease,
                shard=s,
            )
            for s, gr, ks in grants
        )
        per_key = {k: d for c in parts for k, d in zip(c.keys, c.deliveries, strict=True)}
        claim = Claim(
            partition,
            task,
            "+".join(c.id for c in parts),
            tuple(batch.keys),
            tuple(per_key[k] for k in batch.keys),
            min(c.lease for c in parts),
            min(c.expires for c in parts),
            parts=parts,
        )
        batch.claim = claim
        batch._settle = lambda exc: self._settle(claim, exc)
        return batch

    def _parts(self, claim: Claim | Batch, keys: Sequence[str] | None) -> list[tuple[Claim, Any]]:
        """Per shard part of a claim, the keys of ``keys`` (None: all) it took."""
        if isinstance(claim, Batch):
            c = claim.claim
        elif isinstance(claim, Claim):
            c = claim
        else:  # a claim's TensorDict (as_="tensordict")
            c = getattr(claim, "_flightq_claim", None)
        if c is None:
            raise ProtocolError(
                "ack/nack: this batch was not claimed (a get's answer has no lease)"
            )
        parts = c.parts or (c,)
        want = None if keys is None else set(keys)
        if want is not None:
            mine = {k for p in parts for k in p.keys}
            other = sorted(want - mine)
            if other:
                raise NotFoundError(
                    f"claim {c.id} of {c.partition!r} did not take row key {other[0]!r}",
                    key=other[0],
                    partition=c.partition,
                )
        out = []
        for p in parts:
            ks = None if want is None else [k for k in p.keys if k in want]
            if ks is None or ks:
                out.append((p, ks))
        return out

    def ack(self, claim: Claim | Batch, keys: Sequence[str] | None = None) -> int:
        """Acknowledge rows of a claim on each shard that gave some; see
        :meth:`flightq.Client.ack`. Every shard's part is acked before an error is raised.

        Raises
        ------
        LeaseExpiredError
            From the first shard whose part had lost rows, naming the shard.
        """
        n, late = 0, None
        for p, ks in self._parts(claim, keys):
            try:
                n += self._clients[self._shard(p)].ack(p, ks)
            except LeaseExpiredError as e:
                late = late or at_shard(self.locations[self._shard(p)], e)
        if late is not None:
            raise late
        return n

    def nack(
        self, claim: Claim | Batch, keys: Sequence[str] | None = None, *, failed: bool = False
    ) -> int:
        """Give rows of a claim back on each shard that gave some; see
        :meth:`flightq.Client.nack`."""
        return sum(
            self._clients[self._shard(p)].nack(p, ks, failed=failed)
            for p, ks in self._parts(claim, keys)
        )

    def cancel_claim(self, partition: str, call_id: str) -> int:
        """Stop the claim given ``call_id`` on every shard (see
        :meth:`flightq.Client.cancel_claim`); a shard that cannot be reached is left out.
        Returns how many shards had it waiting."""

        def one(c: Client) -> int:
            try:
                return c.cancel_claim(partition, call_id)
            except UnavailableError:
                return 0

        return sum(self._all(one))

    def dead_letters(self, partition: str, task: str, limit: int = 1000) -> dict[str, Any]:
        """The dead letters of every shard, up to ``limit`` in all (see
        :meth:`flightq.Client.dead_letters`); ``"shards"`` has each shard's answer."""
        res = self._all(lambda c: c.dead_letters(partition, task, limit))
        out: dict[str, Any] = {"keys": [], "why": [], "deliveries": [], "total": 0}
        for r in res:
            room = limit - len(out["keys"])
            for k in ("keys", "why", "deliveries"):
                out[k].extend(r[k][:room])
            out["total"] += r["total"]
        out["shards"] = dict(zip(self.locations, res, strict=True))
        return out

    @staticmethod
    def _shard(part: Claim) -> int:
        assert part.shard is not None, "a claim part names its shard"
        return part.shard

    def _settle(self, claim: Claim, error: BaseException | None) -> None:
        if error is None:
            self.ack(claim)
            return
        key = getattr(error, "key", None)
        for p, _ in self._parts(claim, None):
            client = self._clients[self._shard(p)]
            with contextlib.suppress(FlightqError):
                if isinstance(error, FlightqError) and key in p.keys:
                    client.nack(p, [key], failed=True)
                client.nack(p)


def _summed(receipts: Iterable[PutReceipt]) -> PutCreated | None:
    """What a sharded put created, over its shards' receipts; None if one did not say."""
    made = [r.creation for r in receipts]
    if any(m is None for m in made):
        return None
    return PutCreated(
        created=sum(m.created for m in made if m is not None),
        replay=all(m.replay for m in made if m is not None),
    )


def _rows(v: Any, lo: int, hi: int) -> Any:
    """Rows ``lo:hi`` of a column as :func:`flightq.encode` takes it (views where possible)."""
    return v[lo:hi] if hasattr(v, "__getitem__") else list(v)[lo:hi]


if TYPE_CHECKING:
    # mypy holds both blocking clients to the one interface (a runtime test compares the
    # signatures of all three, the async client's included).
    from ..client.client import Client
    from ..client.interface import DataPlane

    def _conforms(c: Client, s: ShardedClient) -> tuple[DataPlane, DataPlane]:
        return c, s
