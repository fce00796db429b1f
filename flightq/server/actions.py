"""The DoAction handlers: one per action type, from its parsed request to its reply.

:data:`HANDLERS` has one entry per :data:`flightq.protocol.ACTIONS` entry (a test holds
the two together). The server parses an action's body with the action's request type,
calls its handler with an :class:`ActionContext` and sends the reply's ``to_wire()``; a
handler never sees bytes or raw maps, and knows nothing of Flight.

Examples
--------
>>> from flightq.protocol import Clear
>>> from flightq.registry import SchemaRegistry
>>> from flightq.server.staging import Staging
>>> from flightq.server.store import Store
>>> ctx = ActionContext(Store(), SchemaRegistry.default(), Staging())
>>> HANDLERS["stats"](ctx, Stats())
StatsReply(partitions={}, rows=0, bytes=0, waiting_claims=0, held=0, counters=None)
>>> HANDLERS["clear"](ctx, Clear(partition="nope"))
Traceback (most recent call last):
...
flightq.errors.NotFoundError: unknown partition 'nope'
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ProtocolError, ResourceExhaustedError, SchemaError, SchemaMismatchError
from ..protocol import (
    PROTOCOL_VERSION,
    AbortPut,
    AbortPutReply,
    Ack,
    AckReply,
    CancelClaim,
    CancelClaimReply,
    CheckSchemas,
    CheckSchemasReply,
    Clear,
    ClearReply,
    DeadLetters,
    DeadLettersReply,
    Declaration,
    Declare,
    DeclareReply,
    Describe,
    Drop,
    DropReply,
    Health,
    HealthReply,
    Inspect,
    KeysReply,
    ListKeys,
    Message,
    Nack,
    NackReply,
    PartitionStats,
    RegisterSchema,
    Reset,
    ResetReply,
    SchemaRef,
    Snapshot,
    SnapshotReply,
    Stats,
    StatsReply,
)
from ..registry import SchemaRegistry
from ..schema import Schema, diff_schemas
from .budget import (
    MAX_METADATA_BYTES,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMAS,
    REPLY_ENTRY_BYTES,
    keys_size,
)
from .leases import DEFAULT_LEASE, DEFAULT_MAX_FAILURES
from .metrics import Counters
from .replies import Held
from .staging import Staging
from .store import Store

__all__ = ["ActionContext", "Handler", "HANDLERS", "resolve_schema"]


@dataclass(frozen=True)
class ActionContext:
    """What the handlers act on: the server's store, registry, staged puts and folders."""

    store: Store
    registry: SchemaRegistry
    staging: Staging
    #: The shared-memory directory; None: shared memory disabled.
    shm_dir: str | None = None
    #: Where ``snapshot`` writes; None: snapshots are refused.
    snapshot_dir: str | os.PathLike[str] | None = None
    #: The server's counters, reported by ``stats``; None: not reported.
    counters: Counters | None = None
    #: The caller's address as gRPC names it (``ipv4:127.0.0.1:PORT``); None: unknown.
    peer: str | None = None
    #: The largest record batch a put through shared memory may carry; None: not said.
    shm_batch_bytes: int | None = None
    #: The call's hold on the server's room for large replies: a handler whose reply may
    #: be large holds its estimated bytes before building it; None: not bounded.
    reply: Held | None = None
    #: Longest tags a put may give one row (the server's setting); health tells clients.
    max_tags_bytes: int | None = None

    def hold(self, n: int, what: str) -> None:
        """Hold ``n`` bytes of the reply about to be built (:mod:`.replies`)."""
        if self.reply is not None:
            self.reply.hold(n, what)


#: A handler takes the context and the parsed request and returns the reply.
Handler = Callable[[ActionContext, Any], Message]


def resolve_schema(registry: SchemaRegistry, text: str, what: str = "schema") -> Schema:
    """The registry's schema for ``text`` (a schema's JSON), which must match it.

    Raises
    ------
    UnknownSchemaError
        If the registry does not know the schema's name and version.
    SchemaMismatchError
        If the fingerprints differ, with a field-by-field diff.
    ResourceExhaustedError
        If ``text`` is longer than a put's schema metadata may be: no partition could be
        written with it, and it is refused before it is parsed.
    """
    # Characters: never more than the UTF-8 bytes, and counted without a copy.
    if len(text) > MAX_METADATA_BYTES:
        raise ResourceExhaustedError(
            f"{what}: a schema of {len(text)} characters of JSON is longer than any a put "
            f"can carry ({MAX_METADATA_BYTES} bytes of schema metadata); send the schema's "
            "canonical JSON (Schema.canonical_json)",
            expected=MAX_METADATA_BYTES,
            actual=len(text),
        )
    theirs = Schema.from_json(text)
    mine = registry.get(theirs.ref)
    if mine.fingerprint != theirs.fingerprint:
        # Read from the caller's side: the caller's schema is "yours".
        diff = diff_schemas(theirs, mine, labels=("yours", "the server's"))
        raise SchemaMismatchError(
            f"your schema {theirs.ref} (fingerprint {theirs.fingerprint}) differs from the "
            f"server's ({mine.fingerprint}): " + "; ".join(diff)
        )
    return mine


def _health(ctx: ActionContext, req: Health) -> HealthReply:
    from ..shm import probe_reply

    return HealthReply(
        ok=True,
        protocol=PROTOCOL_VERSION,
        partitions=len(ctx.store.partitions()),
        shm=probe_reply(ctx.shm_dir, req.to_dict(), ctx.peer, ctx.shm_batch_bytes),
        max_tags_bytes=ctx.max_tags_bytes,
    )


def _check_schemas(ctx: ActionContext, req: CheckSchemas) -> CheckSchemasReply:
    found = [resolve_schema(ctx.registry, text, CheckSchemas.WHAT) for text in req.schemas]
    return CheckSchemasReply(
        schemas=[SchemaRef(ref=s.ref, fingerprint=s.fingerprint) for s in found]
    )


#: Seconds a schema registered at run time must go unused (not registered again, looked
#: up by a declaration or a schema check) before a full registry may forget it: a client
#: that registered one and declares its partition next is never cut in between.
SCHEMA_IDLE_S = 60.0


def _register_schema(ctx: ActionContext, req: RegisterSchema) -> SchemaRef:
    size = len(req.schema.encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise ResourceExhaustedError(
            f"register_schema: a schema of {size} bytes of JSON is longer than the server's "
            f"limit of {MAX_SCHEMA_BYTES} bytes",
            expected=MAX_SCHEMA_BYTES,
            actual=size,
        )
    s = Schema.from_json(req.schema)
    while True:
        try:
            ctx.registry.register(s, max_schemas=MAX_SCHEMAS)
            break
        except ResourceExhaustedError:
            # Full: the least recently used schema a client registered that no partition
            # uses, idle for SCHEMA_IDLE_S, makes room (a long-lived server whose runs
            # register new versions is never cut off for good).
            if ctx.registry.forget_oldest(ctx.store.schemas_used(), SCHEMA_IDLE_S) is None:
                raise
        except SchemaError as e:
            raise SchemaMismatchError(str(e)) from e
    return SchemaRef(ref=s.ref, fingerprint=s.fingerprint)


def _declare(ctx: ActionContext, req: Declare) -> DeclareReply:
    schema = resolve_schema(ctx.registry, req.schema, Declare.WHAT)
    created = ctx.store.declare(
        req.partition,
        schema,
        req.tasks or [],
        req.group_size,
        req.max_rows,
        DEFAULT_LEASE if req.lease is None else req.lease,
        DEFAULT_MAX_FAILURES if req.max_failures is None else req.max_failures,
    )
    declaration = ctx.store.partition(req.partition).declaration()
    return DeclareReply.parse({"created": created, **declaration})


def _describe(ctx: ActionContext, req: Describe) -> Declaration:
    return Declaration.parse(ctx.store.partition(req.partition).declaration())


def _clear(ctx: ActionContext, req: Clear) -> ClearReply:
    cleared = ctx.store.clear(req.partition, req.keys, req.put_id, req.groups, req.missing_ok)
    return ClearReply(cleared=cleared)


def _reset(ctx: ActionContext, req: Reset) -> ResetReply:
    return ResetReply(reset=ctx.store.reset(req.partition, req.task, req.keys))


def _ack(ctx: ActionContext, req: Ack) -> AckReply:
    acked, lost = ctx.store.ack(req.partition, req.claim, req.keys)
    return AckReply(acked=acked, lost=lost)


def _nack(ctx: ActionContext, req: Nack) -> NackReply:
    released, dead = ctx.store.nack(req.partition, req.claim, req.keys, req.failed)
    return NackReply(released=released, dead=dead)


def _cancel_claim(ctx: ActionContext, req: CancelClaim) -> CancelClaimReply:
    return CancelClaimReply(cancelled=ctx.store.cancel_claim(req.partition, req.call, req.session))


def _dead_letters(ctx: ActionContext, req: DeadLetters) -> DeadLettersReply:
    keys, why, deliveries, total = ctx.store.dead_letters(req.partition, req.task, req.limit)
    # Lists of the store's strings so far: the reply's bytes are made once it is packed.
    ctx.hold(keys_size(keys) + keys_size(why) + REPLY_ENTRY_BYTES * len(keys), "dead_letters")
    return DeadLettersReply(keys=keys, why=why, deliveries=deliveries, total=total)


def _drop(ctx: ActionContext, req: Drop) -> DropReply:
    ctx.store.drop(req.partition)
    return DropReply(dropped=True)


def _abort_put(ctx: ActionContext, req: AbortPut) -> AbortPutReply:
    ctx.store.partition(req.partition)  # NotFoundError: no put of it can be waiting
    gave_up = ProtocolError(f"put to {req.partition!r}: the client gave up a part")
    ctx.staging.fail(req.partition, req.stage, req.parts, gave_up)
    return AbortPutReply(aborted=True)


def _stats(ctx: ActionContext, req: Stats) -> StatsReply:
    # Parsed, not built field by field: a key the store adds and the protocol lacks fails.
    # Each partition's entry takes less than its declaration counts (budget.REPLY_COPIES).
    ctx.hold(ctx.store.declared(), "stats")
    stats = ctx.store.stats()
    staged = ctx.staging.staged()
    for name, p in stats["partitions"].items():
        p["staged_parts"] = staged.get(name, 0)
    if ctx.counters is not None:
        stats["counters"] = ctx.counters.snapshot()
    return StatsReply.parse(stats)


def _inspect(ctx: ActionContext, req: Inspect) -> PartitionStats:
    d = ctx.store.inspect(req.partition)
    d["staged_parts"] = ctx.staging.staged().get(req.partition, 0)
    return PartitionStats.parse(d)


def _list_keys(ctx: ActionContext, req: ListKeys) -> KeysReply:
    return KeysReply.parse(
        ctx.store.list_keys(
            req.partition, req.keys, lambda n: ctx.hold(n, "list_keys"), req.hide_tag_values
        )
    )


def _snapshot(ctx: ActionContext, req: Snapshot) -> SnapshotReply:
    from .snapshot import snapshot_path, write_snapshot

    dest = snapshot_path(ctx.snapshot_dir, req.name)
    only = None if req.partition is None else [req.partition]
    manifest = write_snapshot(ctx.store, dest, only)
    return SnapshotReply(
        path=str(dest), partitions={e["name"]: e["rows"] for e in manifest["partitions"]}
    )


#: The handler of every action type, by name (the keys of ``protocol.ACTIONS``).
HANDLERS: dict[str, Handler] = {
    "declare": _declare,
    "check_schemas": _check_schemas,
    "register_schema": _register_schema,
    "describe": _describe,
    "clear": _clear,
    "reset": _reset,
    "ack": _ack,
    "nack": _nack,
    "cancel_claim": _cancel_claim,
    "dead_letters": _dead_letters,
    "drop": _drop,
    "abort_put": _abort_put,
    "stats": _stats,
    "inspect": _inspect,
    "list_keys": _list_keys,
    "health": _health,
    "snapshot": _snapshot,
}
