"""Fields, roles and shapes; schemas to and from JSON; fingerprints and diffs.

A schema is data: a name, a version and an ordered list of fields. Each field declares a
dtype from the closed vocabulary, a role that decides its layout on the wire, a shape
(``None`` for a variable dim, or ``None`` for the whole shape: any rank), whether rows must
carry it, and an optional codec. Roles decide layout, never the values:

``token``
    one tensor per row whose first dim is the row's sequence length;
``media``
    per row a list of zero or more segments, each a tensor with its own shape;
``scalar``
    one value per row;
``tensor``
    one fixed-rank tensor per row;
``object``
    one msgpack value per row (a string, a number, a list, a map with string keys:
    a prompt's text, a message log, a reward model's inputs), stored as its bytes: a
    declared non-tensor field. Its dtype is ``uint8`` and its shape ``[null]`` (the
    value's bytes), both implied; a codec applies to those bytes (zstd on text).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .codecs import RAW, Codec, codec_from_dict
from .dtypes import DType, dtype
from .errors import SchemaError, UnknownSchemaError

__all__ = ["ROLES", "Field", "Schema", "parse_ref", "diff_schemas"]

ROLES = ("token", "media", "scalar", "tensor", "object")

# Field names are identifiers; "__" is reserved for companion columns (``x__shape``) and
# the key and tag columns (``__key__``, ``__tags__``).
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")

Shape = tuple[int | None, ...] | None


@dataclass(frozen=True)
class Field:
    """One declared column.

    Parameters
    ----------
    name:
        Identifier, without ``__``.
    dtype:
        A tag of :data:`flightq.dtypes.DTYPES`.
    role:
        One of :data:`ROLES`.
    shape:
        Per-row shape (per segment for media): a tuple with ``None`` for variable dims, or
        ``None`` for any rank (media only). Scalars have shape ``()``; a token field's
        first dim is ``None`` (the sequence length).
    required:
        Whether every row must carry the field when it is created.
    codec:
        Payload codec; raw by default.
    doc:
        Free text; not part of the fingerprint.
    """

    name: str
    dtype: str
    role: str
    shape: Shape = None
    required: bool = False
    codec: Codec = RAW
    doc: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = f"field {self.name!r}: "
        at = self.name if isinstance(self.name, str) else None
        if not isinstance(self.name, str) or not _NAME.match(self.name) or "__" in self.name:
            raise SchemaError(
                f"{where}names are identifiers (letters, digits, _) without '__', "
                f"starting with a letter",
                field=at,
            )
        try:
            dtype(self.dtype)  # raises on unknown tags
        except SchemaError as e:
            e.field = at
            raise
        if self.role not in ROLES:
            raise SchemaError(
                f"{where}unknown role {self.role!r}; expected one of {ROLES}",
                field=at,
                actual=self.role if isinstance(self.role, str) else None,
            )
        shape = self.shape
        if shape is not None:
            if not isinstance(shape, (tuple, list)) or any(
                d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0)
                for d in shape
            ):
                raise SchemaError(
                    f"{where}shape must be a list of non-negative ints or null, or null, "
                    f"got {shape!r}",
                    field=at,
                )
            object.__setattr__(self, "shape", tuple(shape))
        if self.role == "scalar" and self.shape not in ((), None):
            raise SchemaError(
                f"{where}a scalar has shape [], got {list(self.shape or ())}",
                field=at,
                expected=[],
                actual=list(self.shape or ()),
            )
        if self.role == "scalar":
            object.__setattr__(self, "shape", ())
            if not isinstance(self.codec, type(RAW)):
                raise SchemaError(
                    f"{where}scalars are plain Arrow columns and take no codec", field=at
                )
        if self.role == "token" and (not self.shape or self.shape[0] is not None):
            raise SchemaError(
                f"{where}a token field's shape starts with null (the sequence length), "
                f"e.g. [null] or [null, 3]; got {self.shape!r}",
                field=at,
            )
        if self.role == "object":
            if self.dtype != "uint8" or self.shape not in (None, (None,)):
                raise SchemaError(
                    f"{where}an object field holds one msgpack value per row as its bytes: "
                    f"its dtype is uint8 and its shape [null] (both implied; leave them "
                    f"out), got dtype {self.dtype!r} and shape {self.shape!r}",
                    field=at,
                )
            object.__setattr__(self, "shape", (None,))
        if self.role == "tensor" and self.shape is None:
            raise SchemaError(
                f"{where}a tensor field has a fixed rank: give its shape as a list", field=at
            )
        if not isinstance(self.required, bool):
            raise SchemaError(f"{where}required must be true or false", field=at)

    @property
    def dt(self) -> DType:
        """The dtype entry."""
        return dtype(self.dtype)

    def to_dict(self, with_doc: bool = True) -> dict[str, Any]:
        """The field as JSON-ready data."""
        d: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "role": self.role,
            "shape": None if self.shape is None else list(self.shape),
            "required": self.required,
        }
        if self.codec is not RAW and self.codec.to_dict() != RAW.to_dict():
            d["codec"] = self.codec.to_dict()
        if with_doc and self.doc:
            d["doc"] = self.doc
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Field:
        """Build a field from its JSON form.

        Raises
        ------
        SchemaError
            On a missing or unknown key, or an invalid declaration.
        """
        if not isinstance(d, Mapping):
            raise SchemaError(f"a field is an object, got {d!r}")
        known = {"name", "dtype", "role", "shape", "required", "codec", "doc"}
        unknown = set(d) - known
        at = d.get("name") if isinstance(d.get("name"), str) else None
        if unknown:
            raise SchemaError(f"field {d.get('name')!r}: unknown keys {sorted(unknown)}", field=at)
        for key in ("name", "role") if d.get("role") == "object" else ("name", "dtype", "role"):
            if key not in d:
                raise SchemaError(f"field {d.get('name')!r}: missing {key!r}", field=at)
        return cls(
            name=d["name"],
            dtype=d.get("dtype", "uint8"),
            role=d["role"],
            shape=d.get("shape", () if d["role"] == "scalar" else None),
            required=d.get("required", False),
            codec=codec_from_dict(d.get("codec")),
            doc=d.get("doc", ""),
        )

    def check_shape(self, shape: tuple[int, ...], where: str = "") -> str | None:
        """Why ``shape`` breaks this declaration, or None if it fits."""
        if self.shape is None:
            return None
        if len(shape) != len(self.shape):
            return f"{where}expected rank {len(self.shape)} {_fmt(self.shape)}, got {shape}"
        for got, want in zip(shape, self.shape, strict=True):
            if want is not None and got != want:
                return f"{where}expected shape {_fmt(self.shape)}, got {shape}"
        return None


def _fmt(shape: Shape) -> str:
    if shape is None:
        return "[any rank]"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


@dataclass(frozen=True)
class Schema:
    """A named, versioned, ordered set of fields.

    Examples
    --------
    >>> s = Schema("demo", 1, [Field("input_ids", "int64", "token", (None,), required=True)])
    >>> s.ref
    'demo@1'
    """

    name: str
    version: int
    fields: tuple[Field, ...]
    doc: str = field(default="", compare=False)

    def __init__(self, name: str, version: int, fields: Iterable[Field], doc: str = "") -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "fields", tuple(fields))
        object.__setattr__(self, "doc", doc)
        if not isinstance(name, str) or not _NAME.match(name) or "__" in name:
            raise SchemaError(f"schema name {name!r} must be an identifier without '__'")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise SchemaError(f"schema {name!r}: version must be an integer >= 1, got {version!r}")
        seen: set[str] = set()
        for f in self.fields:
            if f.name in seen:
                raise SchemaError(
                    f"schema {self.ref}: field {f.name!r} is declared twice", field=f.name
                )
            seen.add(f.name)
        object.__setattr__(self, "_by_name", {f.name: f for f in self.fields})
        canonical = json.dumps(self.to_dict(with_doc=False), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "_canonical", canonical)
        fp = hashlib.sha256(canonical.encode()).hexdigest()[:16]
        object.__setattr__(self, "_fingerprint", fp)

    @property
    def ref(self) -> str:
        """``name@version``."""
        return f"{self.name}@{self.version}"

    @property
    def fingerprint(self) -> str:
        """A stable hash of the canonical form (docs excluded): 16 hex digits."""
        return self._fingerprint  # type: ignore[attr-defined]

    @property
    def canonical_json(self) -> str:
        """The canonical JSON form that the fingerprint hashes and the wire carries."""
        return self._canonical  # type: ignore[attr-defined]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name  # type: ignore[attr-defined]

    def __getitem__(self, name: str) -> Field:
        try:
            return self._by_name[name]  # type: ignore[attr-defined]
        except KeyError:
            raise UnknownSchemaError(
                f"schema {self.ref} declares no field {name!r}; declared: "
                f"{', '.join(f.name for f in self.fields)}",
                field=name if isinstance(name, str) else None,
            ) from None

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def required(self) -> tuple[str, ...]:
        """Names of the required fields."""
        return tuple(f.name for f in self.fields if f.required)

    def to_dict(self, with_doc: bool = True) -> dict[str, Any]:
        """The schema as JSON-ready data."""
        d: dict[str, Any] = {
            "name": self.name,
            "version": self.version,
            "fields": [f.to_dict(with_doc) for f in self.fields],
        }
        if with_doc and self.doc:
            d["doc"] = self.doc
        return d

    def to_json(self) -> str:
        """Pretty JSON, the form of the files under ``schemas/``."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Schema:
        """Build a schema from its JSON form.

        Raises
        ------
        SchemaError
            On a malformed document or an invalid field.
        """
        if not isinstance(d, Mapping):
            raise SchemaError(f"a schema is an object, got {type(d).__name__}")
        unknown = set(d) - {"name", "version", "fields", "doc"}
        if unknown:
            raise SchemaError(f"schema {d.get('name')!r}: unknown keys {sorted(unknown)}")
        for key in ("name", "version", "fields"):
            if key not in d:
                raise SchemaError(f"schema {d.get('name')!r}: missing {key!r}")
        if not isinstance(d["fields"], list):
            raise SchemaError(f"schema {d['name']!r}: 'fields' must be a list")
        return cls(
            d["name"], d["version"], [Field.from_dict(f) for f in d["fields"]], d.get("doc", "")
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Schema:
        """Parse a schema from JSON text.

        Raises
        ------
        SchemaError
            On invalid JSON or an invalid schema.
        """
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise SchemaError(f"schema is not valid JSON: {e}") from e
        except RecursionError as e:  # arrays or objects nested past Python's stack
            raise SchemaError(f"schema is not valid JSON: nested too deeply ({e})") from e
        return cls.from_dict(data)


def parse_ref(ref: str, version: int | None = None) -> tuple[str, int | None]:
    """Split ``"name@3"`` into ``("name", 3)``; ``"name"`` gives ``("name", version)``.

    Raises
    ------
    SchemaError
        If the version part is not an integer.
    """
    if "@" in ref:
        name, _, v = ref.partition("@")
        if not v.isdigit():
            raise SchemaError(
                f"schema reference {ref!r}: expected name@version, e.g. rollout_vlm@1"
            )
        if version is not None and int(v) != version:
            raise SchemaError(f"schema reference {ref!r} conflicts with version={version}")
        return name, int(v)
    return ref, version


def diff_schemas(
    expected: Schema, actual: Schema, labels: tuple[str, str] = ("expected", "actual")
) -> list[str]:
    """Readable differences between two schemas: one line per field (field, expected, actual).

    ``labels`` name the two sides in the lines (``("yours", "the server's")`` where a
    client's schema meets a server's). Returns an empty list when the two have the same
    fingerprint.
    """
    if expected.fingerprint == actual.fingerprint:
        return []
    le, la = labels
    lines: list[str] = []
    if expected.ref != actual.ref:
        lines.append(f"schema: {le} {expected.ref}, {la} {actual.ref}")
    exp = {f.name: f.to_dict(with_doc=False) for f in expected.fields}
    act = {f.name: f.to_dict(with_doc=False) for f in actual.fields}
    for name in list(exp) + [n for n in act if n not in exp]:
        e, a = exp.get(name), act.get(name)
        if e is None:
            lines.append(f"field {name!r}: {le} (absent), {la} {_describe(a)}")
        elif a is None:
            lines.append(f"field {name!r}: {le} {_describe(e)}, {la} (absent)")
        elif e != a:
            keys = [
                k for k in ("dtype", "role", "shape", "required", "codec") if e.get(k) != a.get(k)
            ]
            for k in keys:
                lines.append(f"field {name!r}: {k} {le} {e.get(k)!r}, {la} {a.get(k)!r}")
    order_e = [n for n in exp if n in act]
    order_a = [n for n in act if n in exp]
    if order_e != order_a:
        lines.append(f"field order: {le} {order_e}, {la} {order_a}")
    return lines


def _describe(d: Mapping[str, Any] | None) -> str:
    if d is None:
        return "(absent)"
    return f"{d['dtype']} {d['role']} shape={d['shape']} required={d['required']}"
