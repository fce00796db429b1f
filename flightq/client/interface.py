"""The one interface of every flightq client, and the receipt a put returns.

:class:`DataPlane` is the typed interface :class:`~flightq.Client` and
:class:`~flightq.ShardedClient` both satisfy (code written against it runs on either);
:class:`~flightq.aio.AsyncClient` has the same methods with the same parameters, as
coroutines. A test holds the three to the same names, parameter kinds and defaults.

Examples
--------
>>> import flightq, numpy as np
>>> def produce(c: flightq.DataPlane) -> int:
...     c.create_partition("r", "rollout_text@1", tasks=["train"])
...     return c.put("r", ["g0_0"], {"input_ids": [np.arange(3)]}).rows
>>> with flightq.Server() as srv, flightq.connect(srv.location) as c:
...     produce(c)
1
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import pyarrow as pa

    from ..batch import Batch, Claim
    from ..protocol import PutCreated
    from ..registry import SchemaRegistry
    from ..schema import Schema

__all__ = ["DataPlane", "PutReceipt"]


class PutReceipt(int):
    """The rows a put wrote (an ``int``), and how they travelled.

    Attributes
    ----------
    rows:
        The rows the server acknowledged (the receipt's own value).
    route:
        ``"socket"`` (one DoPut stream), ``"streams=N"`` (N parallel DoPut streams, one
        connection each, stored together) or ``"shm"`` (through a shared-memory
        segment). A sharded put's routes, when its shards' differ, joined by ``"+"``.
    shards:
        For a sharded put, the location of each shard it wrote to; empty otherwise.
    creation:
        What the server says the put created (:class:`flightq.protocol.PutCreated`:
        ``created`` rows, 0 for a retry acknowledged again (``replay``) or a put that only
        added columns); a sharded put's, summed over its shards (without ``groups``).
        None where a server did not say (one older than this field).

    Examples
    --------
    >>> r = PutReceipt(16, "streams=2")
    >>> r == 16, r.rows, r.route, r.created
    (True, 16, 'streams=2', None)
    """

    route: str
    shards: tuple[str, ...]
    creation: PutCreated | None

    def __new__(
        cls,
        rows: int,
        route: str = "socket",
        shards: Iterable[str] = (),
        creation: PutCreated | None = None,
    ) -> PutReceipt:
        self = super().__new__(cls, rows)
        self.route = route
        self.shards = tuple(shards)
        self.creation = creation
        return self

    @property
    def rows(self) -> int:
        """The rows written, as a plain ``int``."""
        return int(self)

    @property
    def created(self) -> int | None:
        """The rows the put created; None where the server did not say."""
        return None if self.creation is None else self.creation.created

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (int(self), self.route, self.shards, self.creation))


@runtime_checkable
class DataPlane(Protocol):
    """What every flightq client offers: control calls, puts, gets and claims.

    See :class:`flightq.Client` for what each method does; :class:`flightq.ShardedClient`
    does the same over several servers.
    """

    def health(self, timeout: float | None = None) -> dict[str, Any]: ...

    def check_schemas(self, schemas: Iterable[Schema]) -> None: ...

    def register_schema(self, schema: Schema) -> None: ...

    def create_partition(
        self,
        name: str,
        schema: str | Schema,
        tasks: Sequence[str] = (),
        group_size: int | None = None,
        *,
        max_rows: int | None = None,
        lease: float | None = None,
        max_failures: int | None = None,
        registry: SchemaRegistry | None = None,
    ) -> bool: ...

    def describe(self, partition: str) -> dict[str, Any]: ...

    def partition_schema(self, partition: str) -> Schema: ...

    def clear(
        self, partition: str, keys: Sequence[str] | None = None, *, missing_ok: bool = False
    ) -> int: ...

    def reset(self, partition: str, task: str, keys: Sequence[str] | None = None) -> int: ...

    def drop(self, partition: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def inspect(self, partition: str) -> dict[str, Any]: ...

    def list_keys(
        self,
        partition: str,
        keys: Sequence[str] | None = None,
        *,
        hide_tag_values: str | None = None,
    ) -> dict[str, dict[str, Any]]: ...

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
    ) -> PutReceipt: ...

    def put_batch(
        self,
        partition: str,
        batch: pa.RecordBatch | Sequence[pa.RecordBatch],
        *,
        overwrite: bool = False,
        timeout: float | None = None,
        put_id: str | None = None,
    ) -> PutReceipt: ...

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
    ) -> Batch: ...

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
    ) -> Batch: ...

    def cancel_claim(self, partition: str, call_id: str) -> int: ...

    def ack(self, claim: Claim | Batch, keys: Sequence[str] | None = None) -> int: ...

    def nack(
        self, claim: Claim | Batch, keys: Sequence[str] | None = None, *, failed: bool = False
    ) -> int: ...

    def dead_letters(self, partition: str, task: str, limit: int = 1000) -> dict[str, Any]: ...

    def snapshot(
        self, name: str, partition: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]: ...

    def partitions(self) -> list[str]: ...

    def close(self) -> None: ...
