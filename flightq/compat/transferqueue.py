"""TransferQueue 0.1.11's key/value interface, over a flightq server.

A verl or NeMo RL process that talks to TransferQueue through its KV calls switches with
one import::

    import flightq.compat.transferqueue as tq

    tq.init({"flightq": {"location": "grpc://head:8815", "schema": "rollout_vlm@1"}})
    meta = tq.kv_batch_put(keys=keys, partition_id="train", fields=td, tags=tags)
    td = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["input_ids"])

The calls take the same argument names and shapes as TransferQueue 0.1.11 (``init``,
``close``, ``kv_put``, ``kv_batch_put``, ``kv_batch_get``, ``kv_batch_get_by_meta``,
``kv_list``, ``kv_clear`` and their ``async_`` twins) and return the same kinds of
results (:class:`KVBatchMeta`, TensorDicts, the ``kv_list`` map); :func:`get_client` and
:class:`BatchMeta` give the rows-by-key part of TransferQueue's lower-level client (what
verl's worker dispatch uses) and its task-mediated fetch (``get_meta``, consumption and
production status: NeMo RL's claim), and :data:`SHIM_PATH` on ``PYTHONPATH`` makes
``import transfer_queue`` find this module (and its ``config.yaml``). Non-tensor values
(strings, dicts) put under names the schema does not declare ride in the rows' tags and
read back as fields. Where flightq is stricter its rule stays, with its typed error:
partitions have a declared schema (from ``init``'s configuration, never inferred from
the first put), an undeclared field or a dtype drift is refused, and reading a key that
is not there is a :class:`KeysNotFoundError` (also the ``ValueError`` TransferQueue
raises). Where TransferQueue is lenient and flightq can be too, it is: a rewrite of a
field overwrites it (unless ``overwrite`` is false), listing an unknown partition
answers ``{}``, and clearing leaves out keys that are not there.
docs/migrating-from-transferqueue.md maps every call.

The configuration is ``init``'s ``conf["flightq"]`` (a dict, or anything with
``.get``, such as an OmegaConf ``DictConfig``):

``location``
    the server, ``grpc://host:port``; else the ``FLIGHTQ_LOCATION`` environment
    variable; else ``init`` starts a server in this process (``close`` stops it) and sets
    ``FLIGHTQ_LOCATION`` for the processes this one starts: every other process of the
    job must be given the location, or it would serve rows of its own.
``schema``
    the ``"name@V"`` of every partition not named in ``partitions``.
``partitions``
    per partition id, its ``"name@V"`` or ``{"schema": ..., "tasks": [...],
    "group_size": n}``. A partition is declared on its first put (declaring is
    idempotent: every process may do it).
``schemas_dir``
    a folder of schemas (``schemas/<name>/v<N>.json``) to use instead of the shipped ones;
    a partition's schema the server does not know is registered with it first.
``overwrite``
    let puts rewrite fields rows already have (default true, as TransferQueue; false
    makes a rewrite a ``ConflictError``).
``warmup_keys``
    a key prefix (NeMo RL's ``"__schema__:"``): a put of such keys, which a program makes
    so that TransferQueue learns the fields before any producer starts, has its field
    names checked against the partition's schema and stores nothing.
``polling_mode``
    TransferQueue's ``controller.polling_mode`` for a configuration that gives none (a
    worker's bare ``init()``): TransferQueue's is its controller's, one for the job.

Entries the section leaves out come from the file :data:`CONF_ENV` names, if set (JSON,
or YAML): for programs that build their configuration from TransferQueue's own
``config.yaml`` (the shim's, under :data:`SHIM_PATH`), as NeMo RL does. Of TransferQueue's
sections only ``controller.polling_mode`` is read (:meth:`KVClient.get_meta`). A
configuration of TransferQueue's own (``controller``, ``backend``, ... and no ``flightq``
section, nor the file) is refused with a ``ProtocolError`` saying what to add.

Like TransferQueue's, the interface is module-level: :func:`init` sets up one
:class:`TransferQueue` for the process and every call goes to it. Code that wants more
than one builds :class:`TransferQueue` objects itself; they have the same methods.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import copy
import dataclasses
import logging
import numbers
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

from .. import forks
from ..batch import Batch
from ..client.recent import Recent
from ..errors import (
    ClaimTimeoutError,
    EncodeError,
    MissingFieldError,
    NotFoundError,
    ProtocolError,
    ShapeError,
    UndeclaredFieldError,
    UnknownSchemaError,
)
from ..registry import SchemaRegistry
from ..rows import is_tensordict
from ..schema import Field
from ..tensor import is_torch
from ..tensordicts import require_tensordict, to_tensordict

log = logging.getLogger(__name__)

__all__ = [
    "BatchMeta",
    "CONF_ENV",
    "FETCH_WAIT_ENV",
    "KVBatchMeta",
    "KeysNotFoundError",
    "SHIM_PATH",
    "TransferQueue",
    "init",
    "close",
    "kv_put",
    "kv_batch_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_list",
    "kv_clear",
    "async_kv_put",
    "async_kv_batch_put",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_list",
    "async_kv_clear",
    "get_client",
    "get_metrics_endpoint",
]


@dataclasses.dataclass
class KVBatchMeta:
    """What a put returns and a get by meta takes: keys, their tags, partition, fields.

    Attributes
    ----------
    keys:
        The rows' keys.
    tags:
        One tag dict per key, as the server holds them after the call.
    partition_id:
        The partition.
    fields:
        The fields every one of these rows has, by name (as TransferQueue lists them).
    extra_info:
        Batch-level information (flightq puts none; kept for code that reads it).

    Raises
    ------
    ValueError
        If keys and tags differ in length, or keys or fields repeat.
    """

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(
                f"keys and tags must have the same length, got {len(self.keys)} and "
                f"{len(self.tags)}"
            )
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("KVBatchMeta: duplicate keys")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise ValueError("KVBatchMeta: duplicate fields")
        self.tags = copy.deepcopy(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        """How many rows."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        """The rows of ``keys_to_select`` only (tags follow their keys).

        Raises
        ------
        ValueError
            If ``keys_to_select`` repeats a key or names one this batch lacks.
        """
        want = list(keys_to_select)
        if len(set(want)) != len(want):
            raise ValueError("select_keys: duplicate keys")
        index = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in want if k not in index]
        if missing:
            raise ValueError(f"select_keys: keys not in this batch: {missing[:3]}")
        return KVBatchMeta(
            keys=want,
            tags=[self.tags[index[k]] for k in want],
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )

    def reorder(self, indexes: Sequence[int]) -> None:
        """Put the rows in the order of ``indexes`` (positions in this batch, negative ones
        counted from the end as Python's), in place.

        Raises
        ------
        ValueError
            If ``indexes`` is not a permutation of this batch's positions (``-1`` and the
            last position name one row: both at once are refused, not a row twice).
        """
        n = self.size
        order = [int(i) + n if -n <= int(i) < 0 else int(i) for i in indexes]
        if sorted(order) != list(range(n)):
            raise ValueError(
                f"reorder: {len(order)} indexes are not an order of this batch's {self.size} "
                "rows (each position once)"
            )
        self.keys = [self.keys[i] for i in order]
        self.tags = [self.tags[i] for i in order]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """This batch cut into ``chunks`` consecutive parts whose sizes differ by one at
        most, the larger first (some empty where there are fewer rows than chunks), as a
        data-parallel group splits a batch between its ranks.

        Raises
        ------
        ValueError
            If ``chunks`` is less than 1.
        """
        if chunks < 1:
            raise ValueError(f"chunk: chunks must be >= 1, got {chunks}")
        base, extra = divmod(self.size, chunks)
        out, at = [], 0
        for i in range(chunks):
            end = at + base + (i < extra)
            out.append(
                KVBatchMeta(
                    keys=self.keys[at:end],
                    tags=self.tags[at:end],
                    partition_id=self.partition_id,
                    fields=self.fields,
                    extra_info=self.extra_info,
                )
            )
            at = end
        return out

    @classmethod
    def concat(cls, data: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """The batches of ``data`` one after another (empty ones left out; none: an empty
        batch), their ``extra_info`` merged.

        Raises
        ------
        ValueError
            If they name other partitions or fields, share a key, or give one
            ``extra_info`` key different values.
        """
        parts = [m for m in data if m is not None and m.size > 0]
        if not parts:
            return cls()
        first = parts[0]
        extra: dict[str, Any] = {}
        for m in parts:
            if m.partition_id != first.partition_id:
                raise ValueError(
                    f"concat: partitions differ ({first.partition_id!r}, {m.partition_id!r})"
                )
            if m.fields is not None and set(m.fields) != set(first.fields or ()):
                raise ValueError(f"concat: fields differ ({first.fields}, {m.fields})")
            for k, v in (m.extra_info or {}).items():
                if k in extra and not _same(extra[k], v):
                    raise ValueError(f"concat: extra_info {k!r} differs between batches")
                extra.setdefault(k, v)
        return cls(
            keys=[k for m in parts for k in m.keys],
            tags=[t for m in parts for t in m.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=extra or None,
        )


def _jagged_later(batch: Batch, names: list[str], out: Any) -> None:
    """Set ``out[name]`` to one jagged tensor ragged on the dim ``name``'s schema leaves
    free (a copy: flightq's own TensorDict holds such rows one by one), as TransferQueue
    gives it: mrope position ids of shape ``[3, L]`` come as ``(N, 3, j)``, their values
    ``(3, total)``, whatever the rows' lengths (``as_nested_tensor`` picks the ragged dim
    from the data: the 3 where every row has one length). Fields of one row length share
    one offsets tensor, so they combine."""
    import torch

    shared: list[Any] = []
    for name in names:
        rows = batch[name]
        r = list(batch.schema[name].shape or ()).index(None)
        lengths = torch.tensor([int(x.shape[r]) for x in rows], dtype=torch.int64)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        same = next((o for o in shared if torch.equal(o, offsets)), None)
        if same is None:
            shared.append(offsets)
        else:
            offsets = same
        out[name] = torch.nested.nested_tensor_from_jagged(
            torch.cat(rows, dim=r),
            offsets,
            jagged_dim=r + 1,
            max_seqlen=int(lengths.max()),
        )


def _ragged_later(f: Field) -> bool:
    """Whether a tensor field's rows vary in one dim, not their first: a TensorDict of
    flightq's holds such rows one by one, TransferQueue's as one jagged tensor."""
    shape = f.shape
    return (
        f.role == "tensor"
        and shape is not None
        and shape[0] is not None
        and (shape.count(None) == 1)
    )


#: The prefix of the tag keys that carry a row's non-tensor fields (a ``uid``, a
#: ``raw_prompt``, a ``reward_model`` dict): TransferQueue stores any object as a field,
#: a flightq schema declares tensors only; the compat keeps such values in the row's tags
#: (msgpack), lists them as fields and hides them from the tags it shows.
_OBJECT = "__tq_field__:"


def _no_parser(data_parser: Callable[[Any], Any] | None) -> None:
    if data_parser is not None:
        raise ProtocolError(
            "data_parser is not supported by flightq: parse references into tensors before the put"
        )


#: The field name errors about a row's tags carry (:data:`flightq.layout.TAGS`).
_TAGS_FIELD = "__tags__"


def _object_value(name: str, key: str, v: Any) -> Any:
    """A non-tensor field's value as its row's tags carry it (numpy scalars and 0-d
    tensors as their values, tuples as lists).

    Raises
    ------
    EncodeError
        If msgpack cannot carry it (an array or tensor, a set, a map with non-string keys),
        naming the field and the row.
    """
    import msgpack

    v = _plain(v)
    try:  # as the server decodes tags: map keys that are not strings are refused there
        msgpack.unpackb(msgpack.packb(v, use_bin_type=True), raw=False)
    except (TypeError, ValueError, OverflowError) as e:
        raise EncodeError(
            f"kv_batch_put: non-tensor field {name!r} of row {key!r} is not a msgpack value "
            f"({e}): declare it as a tensor field in the schema, or convert it (strings, "
            "numbers, lists, maps with string keys, bytes)",
            field=name,
            key=key,
        ) from e
    return v


def _fit_tags(keys: Sequence[str], tags: Sequence[Mapping[str, Any]], cap: int) -> None:
    """Refuse, naming the row and its largest non-tensor field, tags past what the server
    takes of one row's in a put (``cap``: its health's ``max_tags_bytes``)."""
    import msgpack

    for key, t in zip(keys, tags, strict=True):
        size = len(msgpack.packb(t, use_bin_type=True))
        if size > cap:
            sizes = {k: len(msgpack.packb(v, use_bin_type=True)) for k, v in t.items()}
            big = max(sizes, key=sizes.__getitem__)
            if big.startswith(_OBJECT):
                what, field = f"field {big[len(_OBJECT) :]!r}", big[len(_OBJECT) :]
                fix = "put it in a put of its own, or serve with a larger --max-tags-bytes"
            else:
                what, field = f"tag {big!r}", _TAGS_FIELD
                fix = "make it smaller, or keep it beside the data plane"
            raise EncodeError(
                f"kv_batch_put: row {key!r}'s tags and non-tensor fields take {size} bytes, "
                f"more than the server takes of one row's in a put ({cap}: flightq serve "
                f"--max-tags-bytes); the largest is {what} ({sizes[big]} bytes): {fix}",
                field=field,
                key=key,
                expected=cap,
                actual=size,
            )


def _objects(tags: Sequence[Mapping[str, Any]]) -> list[str]:
    """The non-tensor fields every row's tags carry."""
    if not tags:
        return []
    names = [{k[len(_OBJECT) :] for k in t if k.startswith(_OBJECT)} for t in tags]
    return sorted(names[0].intersection(*names[1:]))


def _every_row(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The fields (tensor and non-tensor) every row of a ``list_keys`` answer has."""
    if not rows:
        return []
    tensors = set(rows[0]["fields"]).intersection(*(r["fields"] for r in rows[1:]))
    return sorted(tensors | set(_objects([r["tags"] for r in rows])))


def _rows_match(keys: Sequence[str], fields: Any) -> None:
    """Refuse a TensorDict whose batch dim is not one row per key.

    Raises
    ------
    ShapeError
        Naming both counts.
    """
    if is_tensordict(fields) and (len(fields.batch_size) < 1 or fields.batch_size[0] != len(keys)):
        raise ShapeError(
            f"kv_batch_put: {len(keys)} keys for a TensorDict of batch_size "
            f"{list(fields.batch_size)}",
            expected=len(keys),
            actual=list(fields.batch_size),
        )


def _per_row(name: str, v: Any, n: int) -> list[Any]:
    """A TensorDict's non-tensor entry as one value per row. A ``NonTensorStack`` holds
    one per row. A column put in whole, a numpy array or a list (what
    ``TensorDict({"content": np.array([...], dtype=object)}, batch_size=[n])`` keeps as a
    single ``NonTensorData``), gives its values row by row, as TransferQueue takes them
    (a row that is an array, as the rows of a 2-D one are, as the list it holds); any
    other single value (a string, a dict) is every row's.

    Raises
    ------
    ShapeError
        A column put in whole of another number of values than rows.
    """
    data: Any = getattr(v, "data", None) if type(v).__name__ == "NonTensorData" else None
    if isinstance(data, (list, tuple)) or getattr(data, "ndim", 0) >= 1:
        if len(data) != n:
            raise ShapeError(
                f"kv_batch_put: non-tensor field {name!r} is a column of {len(data)} values "
                f"for {n} rows (a value for every row goes as a string or a map, or one "
                "per row in a NonTensorStack)",
                field=name,
                expected=n,
                actual=len(data),
            )
        return [x.tolist() if getattr(x, "ndim", 0) and hasattr(x, "tolist") else x for x in data]
    return list(v.tolist())


def _user_tags(tags: Mapping[str, Any]) -> dict[str, Any]:
    """A row's tags as its writers gave them (without its non-tensor fields)."""
    return {k: v for k, v in tags.items() if not k.startswith(_OBJECT)}


def _tensors(values: Sequence[Any]) -> bool:
    """Whether a column's values are tensors or numbers (a tensor field's), not objects."""
    import numpy as np

    return bool(values) and all(
        is_torch(v) or isinstance(v, (np.ndarray, np.generic, int, float, bool)) for v in values
    )


def _plain_tags(tags: Any) -> Any:
    """A row's tags with numpy scalars and 0-d arrays and tensors as the Python values they
    hold (TransferQueue pickles what msgpack cannot carry; flightq's tags are msgpack: an
    array or tensor of more elements is refused by the put, naming the row)."""
    if not isinstance(tags, Mapping):
        return tags  # refused by the put, naming the row
    return {k: _plain(v) for k, v in tags.items()}


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    item = getattr(v, "item", None)
    if item is not None and getattr(v, "shape", None) == () and callable(item):
        return item()  # a numpy scalar, a 0-d array or tensor
    return v


def _same(a: Any, b: Any) -> bool:
    """Whether two ``extra_info`` values are equal: of one type, and tensors and arrays
    element by element (their ``==`` has no single truth value)."""
    if type(a) is not type(b):
        return False
    if is_torch(a):  # any dtype and device (numpy knows no bfloat16, nor CUDA memory)
        import torch

        try:
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
        except Exception:  # a nested or meta tensor: no match where it cannot compare
            return False
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # an array
        import numpy as np

        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    try:
        return bool(a == b)
    except Exception:  # an object whose comparison fails is no match
        return False


class KeysNotFoundError(NotFoundError, ValueError):
    """A key or partition a call names is not there: flightq's :class:`NotFoundError`,
    and the ``ValueError`` TransferQueue raises for it."""


#: The sections a TransferQueue configuration has and flightq's does not read (but for
#: ``controller.polling_mode``).
_TQ_SECTIONS = ("controller", "backend", "storage", "client")
#: The environment variable naming a file that holds the ``flightq`` section (JSON or
#: YAML): for programs that build their configuration from TransferQueue's own
#: ``config.yaml`` (NeMo RL), so that no line of theirs changes.
CONF_ENV = "FLIGHTQ_TQ_CONF"
#: How long a fetch (``get_meta``) waits for rows outside polling mode, as TransferQueue's
#: controller does (its ``TQ_CONTROLLER_GET_METADATA_TIMEOUT``, default 1 s).
FETCH_WAIT_ENV = "TQ_CONTROLLER_GET_METADATA_TIMEOUT"


def _container(conf: Any) -> Mapping[str, Any]:
    """``conf`` as a plain mapping (an OmegaConf ``DictConfig`` resolved; None: empty)."""
    if conf is None:
        return {}
    try:
        from omegaconf import OmegaConf  # verl's and NeMo RL's configurations

        if OmegaConf.is_config(conf):
            conf = OmegaConf.to_container(conf, resolve=True)
    except ImportError:
        pass
    if not isinstance(conf, Mapping):
        raise ProtocolError(
            f"init(conf): conf is a mapping with a 'flightq' section, got {type(conf).__name__}"
        )
    return conf


def _section(conf: Any) -> dict[str, Any]:
    """``conf["flightq"]``, as a plain dict, over the file :data:`CONF_ENV` names (its
    entries fill those the section does not give)."""
    conf = _container(conf)
    path = os.environ.get(CONF_ENV)
    if "flightq" not in conf and any(k in conf for k in _TQ_SECTIONS) and not path:
        raise ProtocolError(
            "init(conf): conf is TransferQueue's own configuration (sections "
            f"{sorted(k for k in _TQ_SECTIONS if k in conf)}), with no 'flightq' section: give "
            "conf['flightq'] with the server's 'location' and each partition's 'schema', "
            f"or name a file holding that section in {CONF_ENV} "
            "(docs/migrating-from-transferqueue.md)"
        )
    section = conf.get("flightq") or {}
    if not isinstance(section, Mapping):
        raise ProtocolError("init(conf): conf['flightq'] must be a mapping")
    section = dict(section)
    if path:
        filed = _conf_file(path)
        _check_section(filed, f"{CONF_ENV}={path!r}")
        parts = {**(filed.get("partitions") or {}), **(section.get("partitions") or {})}
        section = {**filed, **section}
        if parts:
            section["partitions"] = parts  # the file's partitions, and conf's over them
    _check_section(section, "init(conf['flightq'])")
    return section


#: The section's entries and the types each takes (None: absent or null).
_SECTION_TYPES: dict[str, tuple[type, ...]] = {
    "location": (str,),
    "schema": (str,),
    "partitions": (Mapping,),
    "schemas_dir": (str, os.PathLike),
    "overwrite": (bool,),
    "warmup_keys": (str,),
    "polling_mode": (bool,),
}
#: The most bytes of the file :data:`CONF_ENV` names that are read.
MAX_CONF_FILE_BYTES = 1 << 20


def _check_section(section: Mapping[str, Any], what: str) -> None:
    """Refuse, naming the entry, a ``flightq`` section whose entries are not of their
    types (a ``tasks: "train"`` would declare five tasks of one letter each)."""

    def bad(where: str, want: str, v: Any) -> ProtocolError:
        return ProtocolError(f"{what}: {where} must be {want}, got {v!r}"[:400])

    for key, types in _SECTION_TYPES.items():
        v = section.get(key)
        if v is not None and (not isinstance(v, types) or (bool not in types and v is True)):
            raise bad(repr(key), " or ".join(t.__name__ for t in types), v)
    for pid, spec in (section.get("partitions") or {}).items():
        where = f"partitions[{pid!r}]"
        if isinstance(spec, str):
            continue
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), str):
            raise bad(where, "a 'name@V' or a map with a 'schema' of that form", spec)
        tasks = spec.get("tasks", [])
        if not isinstance(tasks, (list, tuple)) or not all(isinstance(t, str) for t in tasks):
            raise bad(f"{where}['tasks']", "a list of task names", tasks)
        g = spec.get("group_size")
        if g is not None and (isinstance(g, bool) or not isinstance(g, int)):
            raise bad(f"{where}['group_size']", "an int", g)


def _conf_file(path: str) -> dict[str, Any]:
    """The ``flightq`` section in the file at ``path`` (JSON, or YAML where PyYAML or
    OmegaConf is installed).

    Raises
    ------
    ProtocolError
        If the file cannot be read, or does not hold a mapping.
    """
    what = f"{CONF_ENV}={path!r}"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ProtocolError(f"{what}: not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONF_FILE_BYTES + 1)
    except OSError as e:
        raise ProtocolError(f"{what}: cannot read the file: {e}") from e
    if len(raw) > MAX_CONF_FILE_BYTES:
        raise ProtocolError(f"{what}: longer than {MAX_CONF_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{what}: not UTF-8 text: {e}") from e
    try:
        import json

        loaded = json.loads(text)
    except ValueError:
        try:
            import yaml

            loaded = yaml.safe_load(text)
        except ImportError:
            try:
                from omegaconf import OmegaConf

                loaded = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
            except ImportError:
                raise ProtocolError(
                    f"{what}: not JSON, and neither PyYAML nor OmegaConf is installed to "
                    "read it as YAML"
                ) from None
        except Exception as e:  # PyYAML's errors
            raise ProtocolError(f"{what}: neither JSON nor YAML: {e}") from e
    if isinstance(loaded, Mapping) and isinstance(loaded.get("flightq"), Mapping):
        loaded = loaded["flightq"]
    if not isinstance(loaded, Mapping):
        raise ProtocolError(f"{what}: the file holds no mapping (the 'flightq' section)")
    return dict(loaded)


def _fetch_wait() -> float:
    """Seconds a fetch waits for rows outside polling mode (:data:`FETCH_WAIT_ENV`).

    Raises
    ------
    ProtocolError
        If the variable is not a number of seconds.
    """
    text = os.environ.get(FETCH_WAIT_ENV, "1")
    try:
        wait = float(text)
    except ValueError:
        wait = -1.0
    if not 0 <= wait < float("inf"):
        raise ProtocolError(f"{FETCH_WAIT_ENV}={text!r}: give the seconds a fetch waits")
    return wait


def _polling(conf: Any, section: Mapping[str, Any]) -> bool:
    """TransferQueue's ``controller.polling_mode``, else the section's ``polling_mode``
    (every process that reads the file :data:`CONF_ENV` names: TransferQueue's is its
    controller's, one for the job, where a worker's bare ``init()`` gives none): a fetch
    that finds too few rows ready answers an empty batch instead of waiting."""
    controller = _container(conf).get("controller") or {}
    if isinstance(controller, Mapping) and "polling_mode" in controller:
        v = controller["polling_mode"]
        if not isinstance(v, bool):
            raise ProtocolError(f"init(conf): controller.polling_mode must be a bool, got {v!r}")
        return v
    return bool(section.get("polling_mode", False))


@contextlib.contextmanager
def _not_found() -> Iterator[None]:
    """A :class:`NotFoundError` raised inside as a :class:`KeysNotFoundError` (also the
    ``ValueError`` TransferQueue raises)."""
    try:
        yield
    except NotFoundError as e:
        if type(e) is not NotFoundError:
            raise
        raise KeysNotFoundError(*e.args, **e.attributes()) from e


def _names(x: list[str] | str | None) -> list[str] | None:
    return [x] if isinstance(x, str) else (None if x is None else list(x))


class TransferQueue:
    """The KV interface over one flightq connection (see the module docstring).

    Parameters
    ----------
    conf:
        The configuration; its ``"flightq"`` section is read.
    """

    def __init__(self, conf: Any = None) -> None:
        import flightq

        self.conf = _section(conf)
        self.polling = _polling(conf, self.conf)
        warm = self.conf.get("warmup_keys")
        if warm is not None and (not isinstance(warm, str) or not warm):
            raise ProtocolError("init(conf): conf['flightq']['warmup_keys'] is a key prefix")
        self.warmup_keys: str | None = warm
        registry = None
        if self.conf.get("schemas_dir"):
            registry = SchemaRegistry.from_dir(self.conf["schemas_dir"])
        self.registry = registry or SchemaRegistry.default()
        self.overwrite = bool(self.conf.get("overwrite", True))
        location = self.conf.get("location") or os.environ.get("FLIGHTQ_LOCATION")
        self.server: Any = None
        if not location:
            self.server = flightq.Server(registry=self.registry).start()
            location = self.server.location
        self.location = str(location)
        try:
            self.client = flightq.connect(self.location, registry=self.registry)
            # What the server takes of one row's tags (non-tensor fields ride in them).
            from ..server.budget import MAX_TAGS_BYTES

            told = self.client.health().get("max_tags_bytes")
            self.max_tags_bytes = int(told) if told else MAX_TAGS_BYTES
        except BaseException:
            if self.server is not None:
                self.server.stop()
            raise
        # The partitions this process declared, of those it used last.
        self._declared: Recent[str, bool] = Recent()

    # ------------------------------------------------------------------ partitions

    def _declaration(self, partition_id: str) -> dict[str, Any]:
        parts = self.conf.get("partitions") or {}
        spec = parts.get(partition_id, self.conf.get("schema"))
        if spec is None:
            raise NotFoundError(
                f"partition {partition_id!r} has no schema: declare it in init's "
                f"conf['flightq']['partitions'][{partition_id!r}] (or a default "
                "conf['flightq']['schema']); flightq never infers a schema from the first "
                "put (`flightq schema draft` writes one from a sample)",
                partition=partition_id,
            )
        return {"schema": spec} if isinstance(spec, str) else dict(spec)

    def _ensure(self, partition_id: str) -> None:
        if self._declared.get(partition_id):  # a use: a busy partition stays known
            return
        try:
            d = self._declaration(partition_id)
        except NotFoundError:
            # Not declared here (a worker's bare init(), as TransferQueue's joins the
            # job): the partition another process declared on the server serves as is.
            try:
                self.client.describe(partition_id)
            except NotFoundError:
                raise NotFoundError(
                    f"partition {partition_id!r} has no schema: the server has no such "
                    "partition, and init's conf['flightq'] declares none for it "
                    f"(['partitions'][{partition_id!r}] or a default ['schema']); flightq "
                    "never infers a schema from the first put (`flightq schema draft` "
                    "writes one from a sample)",
                    partition=partition_id,
                ) from None
            self._declared[partition_id] = True
            return

        def declare() -> None:
            self.client.create_partition(
                partition_id,
                d["schema"],
                tasks=list(d.get("tasks", ())),
                group_size=d.get("group_size"),
                registry=self.registry,
            )

        try:
            declare()
        except UnknownSchemaError:
            if not self.conf.get("schemas_dir"):
                raise
            # A schema of this process's schemas_dir the server does not know: registered
            # with it (its evolution rules apply), then declared.
            self.client.register_schema(self.registry.get(str(d["schema"])))
            declare()
        self._declared[partition_id] = True

    # ------------------------------------------------------------------ puts

    def kv_put(
        self,
        key: str,
        partition_id: str,
        fields: Any = None,
        tag: dict[str, Any] | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> KVBatchMeta:
        """One row: ``fields`` a dict of the row's values (or a TensorDict of batch size
        1), ``tag`` its tags; either may be None, not both."""
        if fields is None and tag is None:
            raise EncodeError("kv_put: give fields or tag (or both)")
        columns: Any = None
        if fields is not None:
            if is_tensordict(fields):
                columns = fields
            elif isinstance(fields, Mapping):
                for name, v in fields.items():
                    if getattr(v, "is_nested", False):
                        raise ShapeError(
                            f"kv_put: field {name!r} is a nested tensor (several rows); use "
                            "kv_batch_put",
                            field=name,
                        )
                columns = {name: [v] for name, v in fields.items()}
            else:
                raise EncodeError(
                    f"kv_put: fields is a dict or a TensorDict, got {type(fields).__name__}",
                    actual=type(fields).__name__,
                )
        return self.kv_batch_put(
            [key], partition_id, columns, None if tag is None else [tag], data_parser
        )

    def kv_batch_put(
        self,
        keys: list[str],
        partition_id: str,
        fields: Any = None,
        tags: list[dict[str, Any]] | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> KVBatchMeta:
        """Rows by key, all or nothing, in one put: ``fields`` a TensorDict whose batch
        dim is the rows (or a dict of per-row columns), ``tags`` one dict per key. Returns
        the rows' :class:`KVBatchMeta`: their tags and every field they all have, as the
        server holds them after the put; where another process cleared the rows (or
        dropped the partition) before they could be listed, the tags and fields this put
        sent, since the put was stored all the same."""
        _no_parser(data_parser)
        keys = list(keys)
        if self.warmup_keys is not None and any(
            isinstance(k, str) and k.startswith(self.warmup_keys) for k in keys
        ):
            return self._warmup(keys, partition_id, fields, tags)
        sent = self._put(keys, partition_id, fields, tags)
        try:
            return self._meta(partition_id, keys)
        except NotFoundError:
            # Stored, then cleared (or its partition dropped) by another process before
            # they could be listed: the put still succeeded, described by what it sent.
            return self._sent_meta(partition_id, keys, sent, tags)

    def _warmup(
        self, keys: list[str], partition_id: str, fields: Any, tags: list[dict[str, Any]] | None
    ) -> KVBatchMeta:
        """A put of warm-up rows (keys under ``warmup_keys``): written to TransferQueue so
        that it learns the fields before any producer starts. flightq's schema is declared
        before any put, so their field names are checked against it and nothing is stored.

        Raises
        ------
        ProtocolError
            If some keys are warm-up keys and others not.
        UndeclaredFieldError
            Naming a tensor field the partition's schema does not declare.
        """
        prefix = self.warmup_keys
        assert prefix is not None
        other = next((k for k in keys if not (isinstance(k, str) and k.startswith(prefix))), None)
        if other is not None:
            raise ProtocolError(
                f"kv_batch_put: keys under warmup_keys {prefix!r} (checked, not stored) "
                f"beside key {other!r} (stored): put them apart"
            )
        _rows_match(keys, fields)
        self._ensure(partition_id)
        given = fields if is_tensordict(fields) or isinstance(fields, Mapping) else {}
        cols, objects = self._split(partition_id, len(keys), given)
        schema = self.client.partition_schema(partition_id)
        tensors = list(cols.keys())  # iterating a TensorDict walks its rows
        lacking = [n for n in tensors if n not in schema]
        if lacking:
            raise UndeclaredFieldError(
                f"kv_batch_put to {partition_id!r}: warm-up rows name field {lacking[0]!r}, "
                f"which schema {schema.ref} does not declare (declared: "
                f"{[f.name for f in schema.fields]}); declare it, or leave it out",
                field=lacking[0],
                partition=partition_id,
            )
        return self._sent_meta(partition_id, keys, [*tensors, *objects], tags)

    def _put(
        self, keys: list[str], partition_id: str, fields: Any, tags: list[dict[str, Any]] | None
    ) -> list[str]:
        """The put of :meth:`kv_batch_put`, listing nothing after; returns the fields sent.

        Raises
        ------
        EncodeError
            Neither fields nor tags; a tag key that names a non-tensor field
            (:data:`_OBJECT`), or a non-tensor value msgpack cannot carry, naming the field
            and the row.
        ShapeError
            Fields or tags of another number of rows than keys.
        """
        if fields is None and tags is None:
            raise EncodeError("kv_batch_put: give fields or tags (or both)")
        _rows_match(keys, fields)
        if tags is not None and len(tags) != len(keys):
            raise ShapeError(
                f"kv_batch_put: {len(tags)} tags for {len(keys)} keys",
                expected=len(keys),
                actual=len(tags),
            )
        self._ensure(partition_id)
        cols, objects = self._split(partition_id, len(keys), {} if fields is None else fields)
        if tags is not None:
            tags = [_plain_tags(t) for t in tags]
            hidden = next(
                (
                    k
                    for t in tags
                    if isinstance(t, Mapping)
                    for k in t
                    if isinstance(k, str) and k.startswith(_OBJECT)
                ),
                None,
            )
            if hidden is not None:
                raise EncodeError(
                    f"kv_batch_put: tag key {hidden!r} starts with {_OBJECT!r}, which the "
                    "compat keeps for non-tensor fields: put it as a field, or rename it",
                    field=_TAGS_FIELD,
                )
        if objects:  # carried in the rows' tags, beside the caller's
            tags = [dict(t or {}) for t in tags] if tags is not None else [{} for _ in keys]
            for name, values in objects.items():
                for key, t, v in zip(keys, tags, values, strict=True):
                    t[_OBJECT + name] = _object_value(name, key, v)
            _fit_tags(keys, tags, self.max_tags_bytes)
        try:
            self.client.put(partition_id, keys, cols, tags, overwrite=self.overwrite)
        except NotFoundError as e:
            if type(e) is not NotFoundError or e.partition != partition_id:
                raise  # not the partition itself (media the server no longer holds)
            # Dropped since this process declared it (another process, or the command
            # line): the first put declares it again, as TransferQueue creates one.
            self._declared.pop(partition_id)
            self._ensure(partition_id)
            self.client.put(partition_id, keys, cols, tags, overwrite=self.overwrite)
        return [*cols.keys(), *objects]

    def _split(self, partition_id: str, n: int, fields: Any) -> tuple[Any, dict[str, list[Any]]]:
        """``fields`` less their non-tensor entries under names the partition's schema
        does not declare (strings, dicts, a ``NonTensorStack``), and those entries as
        ``{name: one value per row}``: they travel in the rows' tags (:data:`_OBJECT`). A
        tensor under an undeclared name stays, for the put to refuse naming it. A name the
        schema declares as an object field stays, its column of its own; given in a
        TensorDict as one ``NonTensorData`` column, it is split into one value per row
        (:func:`_per_row`)."""
        schema = self.client.partition_schema(partition_id)
        if is_tensordict(fields):
            entries = list(fields.keys())  # iterating a TensorDict walks its rows
            whole = [
                k
                for k in entries
                if isinstance(k, str)
                and k in schema
                and schema[k].role == "object"
                and type(fields.get(k)).__name__ == "NonTensorData"
            ]
            if whole:  # a declared object field's column put in whole: one value per row
                import tensordict as td

                fields = fields.clone(False)
                for k in whole:
                    fields.set(k, td.NonTensorStack.from_list(_per_row(k, fields.get(k), n)))
            names = [k for k in entries if isinstance(k, str) and k not in schema]
            objects = {k: fields.get(k) for k in names if not is_torch(fields.get(k))}
            objects = {k: v for k, v in objects.items() if hasattr(v, "tolist")}
            if not objects:
                return fields, {}
            return fields.exclude(*objects), {k: _per_row(k, v, n) for k, v in objects.items()}
        if not isinstance(fields, Mapping):
            return fields, {}
        objects = {
            k: list(v)
            for k, v in fields.items()
            if k not in schema
            and (
                (isinstance(v, (list, tuple)) and not _tensors(v))
                or (
                    getattr(getattr(v, "dtype", None), "kind", "") == "O"
                    and getattr(v, "ndim", 0) == 1
                )
            )
        }
        for k, v in objects.items():
            if len(v) != n:
                raise ShapeError(
                    f"kv_batch_put: field {k!r} has {len(v)} values for {n} keys",
                    field=k,
                    expected=n,
                    actual=len(v),
                )
        return {k: v for k, v in fields.items() if k not in objects}, objects

    def _sent_meta(
        self,
        partition_id: str,
        keys: list[str],
        sent: list[str],
        tags: list[dict[str, Any]] | None,
    ) -> KVBatchMeta:
        return KVBatchMeta(
            keys=keys,
            tags=[dict(t or {}) for t in tags] if tags is not None else [{} for _ in keys],
            partition_id=partition_id,
            fields=sorted(sent),  # by name, as TransferQueue lists them
        )

    def _every(self, partition_id: str, keys: list[str]) -> list[str]:
        """The fields every row of ``keys`` has (a key may repeat; non-tensor fields
        included), by name."""
        listed = self.client.list_keys(partition_id, keys, hide_tag_values=_OBJECT)
        return _every_row([listed[k] for k in dict.fromkeys(keys)])

    def _meta(self, partition_id: str, keys: list[str]) -> KVBatchMeta:
        listed = self.client.list_keys(partition_id, keys, hide_tag_values=_OBJECT)
        rows = [listed[k] for k in keys]
        return KVBatchMeta(
            keys=keys,
            tags=[_user_tags(r["tags"]) for r in rows],
            partition_id=partition_id,
            fields=_every_row(rows),  # by name, as TransferQueue lists them
        )

    # ------------------------------------------------------------------ gets

    def kv_batch_get(
        self,
        keys: list[str] | str,
        partition_id: str,
        select_fields: list[str] | str | None = None,
    ) -> Any:
        """Rows by key as a TensorDict (batch dim = rows), with ``select_fields`` or every
        field the rows have: of those, the fields every row has (tensor fields, and the
        non-tensor ones their tags carry), in name order."""
        td = require_tensordict()
        ks = _names(keys) or []
        if not ks:
            raise ProtocolError("kv_batch_get: no keys (TransferQueue refuses an empty list too)")
        want = _names(select_fields)

        def read(fields: list[str] | None) -> tuple[Batch, Any]:
            batch = self.client.get(partition_id, ks, fields, as_="torch", hide_tag_values=hide)
            out = to_tensordict(batch, meta=False)  # no per-row keys and tags
            later = [n for n in batch.fields if _ragged_later(batch.schema[n])]
            if later and len(batch):
                _jagged_later(batch, later, out)
            return batch, out

        every: list[str] | None = None  # the fields every row has, once listed
        with _not_found():
            schema = self.client.partition_schema(partition_id)
            # Names the schema does not declare can only be non-tensor fields (tags).
            tensors = None if want is None else [f for f in want if f in schema]
            # No non-tensor field asked: their values stay on the server.
            hide = _OBJECT if want is not None and len(tensors or ()) == len(want) else None
            try:
                batch, out = read(tensors)
            except MissingFieldError as e:
                if e.partition is not None and e.partition != partition_id:
                    raise
                # As TransferQueue reads: only the fields every row has (of those asked;
                # a name no row has, declared or not, is left out).
                every = self._every(partition_id, ks)
                tensors = [f for f in every if f in schema and (tensors is None or f in tensors)]
                batch, out = read(tensors)
            objects = _objects(batch.tags)
            for name in objects if want is None else [o for o in objects if o in want]:
                out[name] = td.NonTensorStack.from_list([t[_OBJECT + name] for t in batch.tags])
        names = sorted(out.keys())
        if not names:
            if not (self._every(partition_id, ks) if every is None else every):
                raise MissingFieldError(
                    f"kv_batch_get from {partition_id!r}: no field is present in every row of "
                    f"the {len(ks)} keys (a row holds tags alone, or its fields are not written "
                    "yet); TransferQueue raises too ('Some fields are not ready')",
                    partition=partition_id,
                )
            return td.TensorDict({}, batch_size=[0])  # none of those asked: TransferQueue's
        return out.select(*names)  # TransferQueue orders fields by name

    def kv_batch_get_by_meta(
        self, meta: KVBatchMeta, select_fields: list[str] | str | None = None
    ) -> Any:
        """The rows of ``meta`` (a put's result) with ``select_fields`` (which must be in
        ``meta.fields``), or with ``meta.fields``."""
        if meta.partition_id is None:
            raise ProtocolError("kv_batch_get_by_meta: the KVBatchMeta has no partition_id")
        want = _names(select_fields)
        if want is not None:
            lacking = [f for f in want if meta.fields is None or f not in meta.fields]
            if lacking:
                raise MissingFieldError(
                    f"select_fields {lacking} not found in the KVBatchMeta's fields {meta.fields}",
                    field=lacking[0],
                    partition=meta.partition_id,
                )
        else:
            want = meta.fields
        return self.kv_batch_get(list(meta.keys), meta.partition_id, want)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        """``{partition_id: {key: tags}}`` for one partition, or every one when None (a
        partition that is not there: ``{}``, as TransferQueue answers)."""
        names = self.client.partitions() if partition_id is None else [partition_id]
        out = {}
        for p in names:
            try:
                listed = self.client.list_keys(p, hide_tag_values=_OBJECT)  # names, no values
                out[p] = {k: _user_tags(row["tags"]) for k, row in listed.items()}
            except NotFoundError as e:
                if type(e) is not NotFoundError or e.partition != p or e.key is not None:
                    raise
        return out

    def kv_clear(self, keys: list[str] | str, partition_id: str) -> None:
        """Remove rows by key; keys (or a partition) that are not there are left out, as
        TransferQueue does."""
        # Keys not there (never were, or another process cleared them meanwhile: the
        # ranks of a data-parallel group clearing one step) are skipped by the server.
        names = _names(keys) or []
        try:
            self.client.clear(partition_id, names, missing_ok=True)
        except NotFoundError as e:
            if type(e) is not NotFoundError or e.partition != partition_id or e.key is not None:
                raise
            # the partition itself is not there: nothing to clear
        _IDS.forget(partition_id, names)

    # ------------------------------------------------------------------ by task

    def _fetch(
        self, partition_id: str, task: str, fields: list[str], batch_size: int
    ) -> tuple[list[str], list[dict[str, Any]]] | None:
        """The keys and tags of the next ``batch_size`` rows ``task`` has not consumed
        that have every one of ``fields`` the schema declares, consumed by it now:
        claimed and acknowledged at once, never delivered to the task again (what
        TransferQueue's fetch does). None where fewer are ready in polling mode.

        Raises
        ------
        ClaimTimeoutError
            Outside polling mode, where fewer are ready within :data:`FETCH_WAIT_ENV`
            seconds (default 1).
        NotFoundError
            If the partition declares no such task.
        """
        self._ensure(partition_id)
        schema = self.client.partition_schema(partition_id)
        odd = next((f for f in fields if f not in schema), None)
        if odd is not None:
            raise UndeclaredFieldError(
                f"get_meta from {partition_id!r}: a fetch waits for fields schema "
                f"{schema.ref} declares, and it does not declare {odd!r} (a non-tensor "
                "field rides in the rows' tags, which a fetch does not wait for: leave it "
                "out of data_fields and read it by key)",
                field=odd,
                partition=partition_id,
            )
        wait = 0.0 if self.polling else _fetch_wait()
        try:
            batch = self.client.claim(
                partition_id,
                task,
                batch_size,
                fields=[],
                wait_for=list(fields),
                timeout=wait,
                as_="numpy",
                hide_tag_values=_OBJECT,  # the rows' tags without non-tensor values
            )
        except ClaimTimeoutError:
            if self.polling:
                return None
            raise
        try:
            self.client.ack(batch)
        except BaseException:
            # Not consumed, and the caller never learns these keys: give them back at
            # once rather than leave them leased to no one until the lease runs out.
            with contextlib.suppress(Exception):
                self.client.nack(batch)
            raise
        return list(batch.keys), [_user_tags(t) for t in batch.tags]

    def _rows(self, partition_id: str) -> tuple[list[str], list[dict[str, Any]]]:
        """Every row's key and tags, in the order put (TransferQueue's force fetch)."""
        listed = self.client.list_keys(partition_id, hide_tag_values=_OBJECT)
        return list(listed), [_user_tags(r["tags"]) for r in listed.values()]

    def _status(self, partition_id: str) -> dict[str, Any] | None:
        """The partition's counts (``inspect``); None where it is not there."""
        try:
            return self.client.inspect(partition_id)
        except NotFoundError as e:
            if type(e) is not NotFoundError or e.key is not None:
                raise
            return None

    def close(self) -> None:
        """Close the connection, and stop the server ``init`` started, if any."""
        self.client.close()
        if self.server is not None:
            self.server.stop()
            self.server = None


# --------------------------------------------------------------------------- module level

#: The process's TransferQueue, as TransferQueue keeps one client per process.
_TQ: TransferQueue | None = None
_TQ_LOCK = threading.Lock()


def _tq() -> TransferQueue:
    if _TQ is None:
        raise ProtocolError(
            "flightq.compat.transferqueue is not initialised: call init(conf) first"
        )
    return _TQ


def init(conf: Any = None) -> dict[str, Any]:
    """Connect this process (starting a server when no location is configured).

    A second call while initialised keeps the first connection, as TransferQueue's does.
    Returns the ``flightq`` section in use, with the ``location`` filled in.

    Raises
    ------
    SchemaError, UnavailableError
        If ``schemas_dir`` is invalid or the server cannot be reached.
    """
    forks.check("flightq.compat.transferqueue.init")  # the inherited client would hang
    global _TQ
    with _TQ_LOCK:
        if _TQ is None:
            located = _section(conf).get("location") or os.environ.get("FLIGHTQ_LOCATION")
            if not located and _in_ray_worker():
                raise ProtocolError(
                    "init() in a Ray worker with no location: it would serve rows of its own "
                    "that no other process sees (a Ray actor does not inherit the driver's "
                    "environment). Pass the driver's location: "
                    "runtime_env={'env_vars': {'FLIGHTQ_LOCATION': location}}, or "
                    "conf['flightq']['location']"
                )
            _TQ = TransferQueue(conf)
            if _TQ.server is not None:
                # Processes this one starts (workers of a launcher, multiprocessing) find
                # it there; any other process must be given the location, or it would
                # start a server of its own and see none of these rows.
                os.environ["FLIGHTQ_LOCATION"] = _TQ.location
                log.warning(
                    "flightq.compat.transferqueue: no location configured, so this process "
                    "serves the data itself at %s (FLIGHTQ_LOCATION set for the processes "
                    "it starts); give every other process this location",
                    _TQ.location,
                )
        return {**_TQ.conf, "location": _TQ.location}


def _in_ray_worker() -> bool:
    """Whether this process is a Ray task's or actor's (not a driver's); Ray is not
    imported here where the application has not."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        if not ray.is_initialized():
            return False
        ctx = ray.get_runtime_context()
        return ctx.get_actor_id() is not None or ctx.get_task_id() is not None
    except Exception:  # another Ray's API: not known to be a worker
        return False


def close() -> None:
    """Close this process's connection (and the server ``init`` started); idempotent."""
    global _TQ
    with _TQ_LOCK:
        tq, _TQ = _TQ, None
    if tq is not None:
        if tq.server is not None and os.environ.get("FLIGHTQ_LOCATION") == tq.location:
            del os.environ["FLIGHTQ_LOCATION"]  # the one init exported: gone with it
        tq.close()


def kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """One row (see :meth:`TransferQueue.kv_put`)."""
    return _tq().kv_put(key, partition_id, fields, tag, data_parser)


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Rows by key, all or nothing (see :meth:`TransferQueue.kv_batch_put`)."""
    return _tq().kv_batch_put(keys, partition_id, fields, tags, data_parser)


def kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    """Rows by key as a TensorDict (see :meth:`TransferQueue.kv_batch_get`)."""
    return _tq().kv_batch_get(keys, partition_id, select_fields)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    """The rows of a put's result (see :meth:`TransferQueue.kv_batch_get_by_meta`)."""
    return _tq().kv_batch_get_by_meta(meta, select_fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """Keys and tags per partition (see :meth:`TransferQueue.kv_list`)."""
    return _tq().kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Remove rows by key (see :meth:`TransferQueue.kv_clear`)."""
    _tq().kv_clear(keys, partition_id)


#: Threads the async calls of a process run on: their own, so that the event loop's
#: default executor (asyncio.to_thread, run_in_executor(None, ...)), which an
#: application's own blocking work shares, never queues behind the data plane's calls.
ASYNC_THREADS = 16
_POOL: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()  # not _TQ_LOCK: init holds that while it connects


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the compat's own threads, in the caller's context."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():  # a child's pool is its own
            _POOL = (
                os.getpid(),
                concurrent.futures.ThreadPoolExecutor(ASYNC_THREADS, "flightq-tq"),
            )
        pool = _POOL[1]
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(pool, ctx.run, fn, *args)


async def async_kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """:func:`kv_put` without blocking the event loop."""
    return await _off_loop(kv_put, key, partition_id, fields, tag, data_parser)


async def async_kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """:func:`kv_batch_put` without blocking the event loop."""
    return await _off_loop(kv_batch_put, keys, partition_id, fields, tags, data_parser)


async def async_kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    """:func:`kv_batch_get` without blocking the event loop."""
    return await _off_loop(kv_batch_get, keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None
) -> Any:
    """:func:`kv_batch_get_by_meta` without blocking the event loop."""
    return await _off_loop(kv_batch_get_by_meta, meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """:func:`kv_list` without blocking the event loop."""
    return await _off_loop(kv_list, partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """:func:`kv_clear` without blocking the event loop."""
    await _off_loop(kv_clear, keys, partition_id)


# --------------------------------------------------------------------------- lower level

#: A folder holding a ``transfer_queue`` package that is this module: put it first on
#: ``PYTHONPATH`` (the driver's, and every Ray worker's through its ``runtime_env``) and
#: code that imports ``transfer_queue`` by name (verl, in seven of its files) runs on
#: flightq unchanged.
SHIM_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")

#: Row ids (``BatchMeta.global_indexes``) this process keeps at most: the ids of the
#: rows read last (verl resolves them within a step, in the process that asked).
MAX_IDS = 1 << 18


class _Ids:
    """This process's integer ids of rows, as TransferQueue's ``global_indexes``: flightq
    addresses rows by key alone, and verl hands the ids back alone (``kv_retrieve_keys``).
    A row keeps its id while it is among the :data:`MAX_IDS` used last and not cleared."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._keys: dict[int, tuple[str, str]] = {}
        self._next = 0

    def ids(self, partition_id: str, keys: Sequence[str]) -> list[int]:
        out = []
        with self._lock:
            for k in keys:
                i = self._of.get((partition_id, k))
                if i is None:
                    i, self._next = self._next, self._next + 1
                    self._keys[i] = (partition_id, k)
                self._of[(partition_id, k)] = i
                self._of.move_to_end((partition_id, k))
                out.append(i)
            while len(self._of) > MAX_IDS:
                _, gone = self._of.popitem(last=False)
                del self._keys[gone]
        return out

    def keys(self, partition_id: str, ids: Sequence[int]) -> list[str]:
        with self._lock:
            found = [self._keys.get(int(i)) for i in ids]
        for i, got in zip(ids, found, strict=True):
            if got is not None and got[0] != partition_id:
                raise KeysNotFoundError(
                    f"kv_retrieve_keys: row id {i} is of partition {got[0]!r}, not "
                    f"{partition_id!r}",
                    partition=partition_id,
                )
            if got is None:
                raise KeysNotFoundError(
                    f"kv_retrieve_keys: row id {i} of partition {partition_id!r} was not given "
                    "by this process's kv_retrieve_meta (ids are per process, and a cleared "
                    f"row's, or one past the {MAX_IDS} used last, is forgotten)",
                    partition=partition_id,
                )
        return [got[1] for got in found if got is not None]

    def forget(self, partition_id: str, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                i = self._of.pop((partition_id, k), None)
                if i is not None:
                    del self._keys[i]


_IDS = _Ids()


class BatchMeta:
    """TransferQueue's lower-level handle on rows, as verl's worker dispatch uses it: the
    rows by position (``global_indexes``, ids of this process's :func:`get_client`), their
    partitions, the fields every row has (``field_names``, by name) and batch-level
    ``extra_info``. It carries the rows' keys, so a worker in another process reads and
    writes them with no lookup; it pickles (it crosses Ray).

    The constructor takes TransferQueue's arguments (``field_schema``'s keys are the
    fields; ``production_status`` and the backend's are not kept), and none (an empty
    batch, as verl builds one). ``custom_meta`` holds each row's tags where
    :meth:`KVClient.get_meta` made it (TransferQueue's per-row metadata), ``{}`` each
    where no one gave them; selections and ``concat`` carry them along.

    Raises
    ------
    ValueError
        If ids, partitions and keys differ in length.
    KeysNotFoundError
        Where no ``keys`` are given, if this process gave none of those ids.
    """

    def __init__(
        self,
        global_indexes: Sequence[int] = (),
        partition_ids: Sequence[str] = (),
        field_schema: Mapping[str, Any] | None = None,
        production_status: Any = None,
        extra_info: Mapping[str, Any] | None = None,
        custom_meta: Any = None,
        _custom_backend_meta: Any = None,
        *,
        keys: Sequence[str] | None = None,
        field_names: Sequence[str] | None = None,
    ) -> None:
        self.global_indexes = [int(i) for i in global_indexes]
        self.partition_ids = list(partition_ids)
        if len(self.global_indexes) != len(self.partition_ids):
            raise ValueError(
                f"BatchMeta: {len(self.global_indexes)} global_indexes for "
                f"{len(self.partition_ids)} partition_ids"
            )
        if keys is None:
            keys = [
                k
                for p, i in zip(self.partition_ids, self.global_indexes, strict=True)
                for k in _IDS.keys(p, [i])
            ]
        self.keys = list(keys)
        if len(self.keys) != len(self.global_indexes):
            raise ValueError(f"BatchMeta: {len(self.keys)} keys for {self.size} rows")
        names = field_names if field_names is not None else list(field_schema or {})
        self._field_names = sorted(dict.fromkeys(names))
        self.extra_info: dict[str, Any] = dict(extra_info or {})
        self.custom_meta: list[dict[str, Any]] = (
            [dict(d) for d in custom_meta] if custom_meta else [{} for _ in self.keys]
        )
        if len(self.custom_meta) != len(self.keys):
            raise ValueError(f"BatchMeta: {len(self.custom_meta)} custom_meta for {self.size} rows")

    @property
    def size(self) -> int:
        """How many rows."""
        return len(self.global_indexes)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        """The fields every row has, by name."""
        return list(self._field_names)

    @property
    def is_ready(self) -> bool:
        """Whether there are rows and fields to read."""
        return self.size > 0 and bool(self._field_names)

    def _like(self, idx: Sequence[int], names: Sequence[str]) -> BatchMeta:
        return BatchMeta(
            [self.global_indexes[i] for i in idx],
            [self.partition_ids[i] for i in idx],
            extra_info=copy.deepcopy(self.extra_info),
            custom_meta=[copy.deepcopy(self.custom_meta[i]) for i in idx],
            keys=[self.keys[i] for i in idx],
            field_names=names,
        )

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """A copy of each row's ``custom_meta``, in row order."""
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: Sequence[Mapping[str, Any]]) -> None:
        """Merge one map per row into the rows' ``custom_meta`` (here only: the rows'
        tags on the server are written by a put's ``tags``).

        Raises
        ------
        ValueError
            If there is not one map per row.
        """
        if len(custom_meta) != self.size:
            raise ValueError(
                f"update_custom_meta: {len(custom_meta)} maps for a batch of {self.size} rows"
            )
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        """Every row's ``custom_meta`` emptied."""
        self.custom_meta = [{} for _ in self.keys]

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        """These rows with those of ``field_names`` they have (a name they lack is left
        out, as TransferQueue's)."""
        return self._like(range(self.size), [f for f in field_names if f in self._field_names])

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        """The rows at these positions, in this order."""
        return self._like(list(sample_indices), self._field_names)

    def __getitem__(self, item: int | slice) -> BatchMeta:
        if isinstance(item, slice):
            return self.select_samples(range(*item.indices(self.size)))
        i = int(item) + (self.size if int(item) < 0 else 0)
        if not 0 <= i < self.size:
            raise IndexError("BatchMeta index out of range")
        return self.select_samples([i])

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """``chunks`` consecutive parts, the first ``size % chunks`` one row longer (some
        empty where there are fewer rows), as TransferQueue's."""
        if chunks < 1:
            raise ValueError(f"chunk: chunks must be at least 1, got {chunks}")
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            end = start + base + (1 if i < extra else 0)
            out.append(self.select_samples(range(start, end)))
            start = end
        return out

    @classmethod
    def concat(cls, data: Sequence[BatchMeta], validate: bool = True) -> BatchMeta:
        """The rows of ``data`` in order (empty parts left out), as TransferQueue's: their
        fields must agree, and so must an ``extra_info`` key two parts carry.

        Raises
        ------
        ValueError
            If the parts' fields or ``extra_info`` values differ.
        """
        parts = [d for d in data if d is not None and d.size > 0]
        if not parts:
            return cls()
        names = parts[0].field_names
        if validate:
            odd = next((d for d in parts if d.field_names != names), None)
            if odd is not None:
                raise ValueError(
                    f"BatchMeta.concat: field_names {odd.field_names} differ from {names}"
                )
        extra: dict[str, Any] = {}
        for d in parts:
            for k, v in d.extra_info.items():
                if k in extra and not _same(extra[k], v):
                    raise ValueError(f"BatchMeta.concat: extra_info {k!r} differs between parts")
                extra.setdefault(k, v)
        return cls(
            [i for d in parts for i in d.global_indexes],
            [p for d in parts for p in d.partition_ids],
            extra_info=extra,
            custom_meta=[copy.deepcopy(m) for d in parts for m in d.custom_meta],
            keys=[k for d in parts for k in d.keys],
            field_names=names,
        )

    @classmethod
    def empty(cls, extra_info: Mapping[str, Any] | None = None) -> BatchMeta:
        """No rows."""
        return cls(extra_info=extra_info)

    def add_fields(self, data: Any) -> BatchMeta:
        """These rows with ``data``'s entries among their fields (after a put of them)."""
        self._field_names = sorted(set(self._field_names) | set(data.keys()))
        return self

    def __repr__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self._field_names}, "
            f"partition_ids={sorted(set(self.partition_ids))}, extra_info={self.extra_info})"
        )


def _one_partition(meta: BatchMeta, what: str) -> str:
    parts = set(meta.partition_ids)
    if len(parts) != 1:
        raise ProtocolError(f"{what}: the rows of one partition, got {sorted(parts)}")
    return parts.pop()


class KVClient:
    """What :func:`get_client` returns: TransferQueue's client calls that address rows by
    key (what verl's worker dispatch makes), over this process's :class:`TransferQueue`.
    Each has an ``async_`` twin, run on the compat's own threads."""

    def kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False
    ) -> BatchMeta:
        """The rows of ``keys`` as a :class:`BatchMeta`: this process's ids for them and
        the fields every row has. An unknown key or partition is a
        :class:`KeysNotFoundError` (TransferQueue leaves such keys out with a warning).

        Raises
        ------
        ProtocolError
            With ``create``: rows are created by a put here (``kv_batch_put``).
        """
        if create:
            raise ProtocolError(
                "kv_retrieve_meta(create=True) is not offered: rows are created by their put"
            )
        ks = _names(keys) or []
        if len(set(ks)) != len(ks):
            raise ProtocolError("kv_retrieve_meta: a key is named twice")
        with _not_found():
            meta = _tq()._meta(partition_id, ks)
        return BatchMeta(
            _IDS.ids(partition_id, ks),
            [partition_id] * len(ks),
            keys=ks,
            field_names=meta.fields or [],
        )

    def kv_retrieve_keys(self, global_indexes: Sequence[int] | int, partition_id: str) -> list[str]:
        """The keys of rows by the ids :meth:`kv_retrieve_meta` gave them in this process.

        Raises
        ------
        KeysNotFoundError
            Naming an id this process did not give (or forgot: see :data:`MAX_IDS`).
        """
        if isinstance(global_indexes, numbers.Integral):
            return _IDS.keys(partition_id, [int(global_indexes)])
        return _IDS.keys(partition_id, list(cast(Sequence[int], global_indexes)))

    def get_data(self, metadata: BatchMeta) -> Any:
        """The rows' ``field_names`` as a TensorDict (batch size 0 where there are no rows
        or no fields, as TransferQueue's)."""
        if metadata.size == 0 or not metadata.field_names:
            return require_tensordict().TensorDict({}, batch_size=[0])
        pid = _one_partition(metadata, "get_data")
        return _tq().kv_batch_get(metadata.keys, pid, metadata.field_names)

    def put(
        self,
        data: Any,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        """Write ``data``'s entries onto the rows of ``metadata`` (new columns: a worker's
        log probs, values, entropy), all or nothing; returns ``metadata`` with them among
        its fields. The rows' tags are left as they are.

        Raises
        ------
        ProtocolError
            Without ``metadata``: TransferQueue's insert mode is not offered
            (``kv_batch_put`` creates rows by key).
        """
        if metadata is None:
            raise ProtocolError(
                "put without metadata (TransferQueue's insert mode) is not offered: create "
                "rows by key with kv_batch_put"
            )
        if metadata.size == 0:
            return metadata
        _no_parser(data_parser)
        if data is None:
            raise EncodeError("put: give the data to write onto the rows")
        pid = _one_partition(metadata, "put")
        _tq()._put(metadata.keys, pid, data, None)  # nothing listed after: verl reads none
        return metadata.add_fields(data)

    def get_meta(
        self,
        data_fields: list[str] | str,
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """Rows for a consumer task, as TransferQueue's client gives them.

        ``mode="fetch"``: the next ``batch_size`` rows (in the order put) that ``task_name``
        has not consumed and that have every one of ``data_fields``, consumed by the task
        now (a flightq claim acknowledged at once: no other fetch of the task gets them
        again, as TransferQueue's; where the acknowledgement fails they are given back
        and the error raised). Where fewer are ready it waits
        ``TQ_CONTROLLER_GET_METADATA_TIMEOUT`` seconds (default 1) and raises
        :class:`~flightq.ClaimTimeoutError` (a ``TimeoutError``), or, in polling mode
        (``init``'s ``conf["controller"]["polling_mode"]``), answers an empty batch at
        once. The task must be among the partition's ``tasks`` (``init``'s configuration).
        ``mode="force_fetch"``: every row, consuming none. Each row's tags are its
        ``custom_meta``. ``sampling_config`` is taken and left unused, as by
        TransferQueue's default sampler (rows in the order put, whatever ``dp_rank``).

        Raises
        ------
        ProtocolError
            ``mode="insert"`` (rows are created by ``kv_batch_put``), a fetch without
            ``task_name``, a ``batch_size`` that is not an int (or below 1 outside polling
            mode).
        UndeclaredFieldError
            A fetch naming a field the schema does not declare (a non-tensor field rides
            in the rows' tags, which a fetch cannot wait for).
        ValueError
            Another ``mode``.
        """
        del sampling_config  # TransferQueue's SequentialSampler reads none of it either
        fields = _names(data_fields) or []
        if mode == "fetch":
            if task_name is None:
                raise ProtocolError("get_meta(mode='fetch'): give the consumer's task_name")
            if not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool):
                raise ProtocolError(f"get_meta: batch_size is an int, got {batch_size!r}")
            if batch_size < 1:
                if _tq().polling:  # TransferQueue's controller answers none
                    return BatchMeta.empty()
                raise ProtocolError(f"get_meta: batch_size must be at least 1, got {batch_size}")
            with _not_found():
                got = _tq()._fetch(partition_id, task_name, fields, int(batch_size))
            if got is None:
                return BatchMeta.empty()
            keys, tags = got
        elif mode == "force_fetch":
            with _not_found():
                keys, tags = _tq()._rows(partition_id)
        elif mode == "insert":
            raise ProtocolError(
                "get_meta(mode='insert') is not offered: create rows by key with kv_batch_put"
            )
        else:
            raise ValueError(f"Invalid mode: {mode!r} (fetch or force_fetch)")
        return BatchMeta(
            _IDS.ids(partition_id, keys),
            [partition_id] * len(keys),
            custom_meta=tags,
            keys=keys,
            field_names=fields,
        )

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """Whether the partition has rows and ``task_name`` consumed every one (fetched
        it, or acknowledged its claim); False for a partition that is not there.

        Raises
        ------
        KeysNotFoundError
            If the partition declares no such task.
        """
        st = _tq()._status(partition_id)
        if st is None:
            return False
        if task_name not in st["acked"]:
            raise KeysNotFoundError(
                f"partition {partition_id!r} declares no task {task_name!r} "
                f"(its tasks: {st['tasks']})",
                partition=partition_id,
            )
        return bool(st["rows"] > 0 and st["acked"][task_name] >= st["rows"])

    def check_production_status(self, data_fields: list[str] | str, partition_id: str) -> bool:
        """Whether the partition has rows and every row has every one of ``data_fields``
        (False for a partition that is not there)."""
        names = _names(data_fields) or []
        tq = _tq()
        st = tq._status(partition_id)
        if st is None or not names:  # TransferQueue answers False for no fields too
            return False
        n = st["rows"]
        schema = tq.client.partition_schema(partition_id)
        tensors = [f for f in names if f in schema]
        if n == 0 or any(st["fields"].get(f, 0) < n for f in tensors):
            return False
        objects = [_OBJECT + f for f in names if f not in schema]
        if not objects:
            return True
        # Non-tensor fields ride in the rows' tags: every row's, by name alone.
        listed = tq.client.list_keys(partition_id, hide_tag_values=_OBJECT)
        return bool(listed) and all(all(o in r["tags"] for o in objects) for r in listed.values())

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Make the partition's rows consumable again by ``task_name`` (every task when
        None): each is fetched (or claimed) once more. Returns True.

        Raises
        ------
        KeysNotFoundError
            If the partition is not there, or declares no such task.
        """
        client = _tq().client
        with _not_found():
            tasks = [task_name] if task_name is not None else client.inspect(partition_id)["tasks"]
            for t in tasks:
                client.reset(partition_id, t)
        return True

    async def async_get_meta(
        self,
        data_fields: list[str] | str,
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """:meth:`get_meta` off the event loop."""
        return await _off_loop(
            self.get_meta, data_fields, batch_size, partition_id, mode, task_name, sampling_config
        )

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """:meth:`check_consumption_status` off the event loop."""
        return await _off_loop(self.check_consumption_status, task_name, partition_id)

    async def async_check_production_status(
        self, data_fields: list[str] | str, partition_id: str
    ) -> bool:
        """:meth:`check_production_status` off the event loop."""
        return await _off_loop(self.check_production_status, data_fields, partition_id)

    async def async_reset_consumption(
        self, partition_id: str, task_name: str | None = None
    ) -> bool:
        """:meth:`reset_consumption` off the event loop."""
        return await _off_loop(self.reset_consumption, partition_id, task_name)

    async def async_kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False
    ) -> BatchMeta:
        """:meth:`kv_retrieve_meta` off the event loop."""
        return await _off_loop(self.kv_retrieve_meta, keys, partition_id, create)

    async def async_kv_retrieve_keys(
        self, global_indexes: Sequence[int] | int, partition_id: str
    ) -> list[str]:
        """:meth:`kv_retrieve_keys` (no call to the server)."""
        return self.kv_retrieve_keys(global_indexes, partition_id)

    async def async_get_data(self, metadata: BatchMeta) -> Any:
        """:meth:`get_data` off the event loop."""
        return await _off_loop(self.get_data, metadata)

    async def async_put(
        self,
        data: Any,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        """:meth:`put` off the event loop."""
        return await _off_loop(self.put, data, metadata, partition_id, data_parser)


_CLIENT = KVClient()


def get_client() -> KVClient:
    """This process's client calls (TransferQueue's ``get_client()``).

    Raises
    ------
    ProtocolError
        If :func:`init` was not called.
    """
    _tq()
    return _CLIENT


def get_metrics_endpoint() -> str | None:
    """None: a flightq server's metrics are ``flightq serve --metrics-port``'s."""
    return None
