"""A registry of versioned schemas, loaded from a folder and checked against the rules.

Layout: ``<dir>/<name>/v<N>.json``, one immutable file per version. The evolution rules
(written in ``schemas/README.md``) are enforced whenever a version is added:

1. version N+1 keeps every field of version N unchanged (name, dtype, role, shape,
   required, codec) and in the same order;
2. it may only append fields, and appended fields are optional;
3. anything else (a removed, renamed, retyped or reshaped field) needs a new schema name.

A registry is an object; :meth:`SchemaRegistry.default` builds one over the schemas that
ship with flightq. Nothing here is module state.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from .errors import EvolutionError, ResourceExhaustedError, SchemaError, UnknownSchemaError
from .schema import Schema, parse_ref

__all__ = ["SchemaRegistry", "check_evolution", "shipped_schema_dir"]

#: Refs a registry forgot (:meth:`SchemaRegistry.forget_oldest`) whose fingerprints it
#: keeps, so that one comes back with its content only: the latest 65 536, each by a
#: 16-byte digest of its ref (a ref may be 32 KiB long), about 100 bytes an entry.
FORGOTTEN_KEPT = 65536

_VERSION_FILE = re.compile(r"^v([1-9][0-9]*)\.json$")


def shipped_schema_dir() -> Path:
    """The folder of schemas that ship with flightq.

    In an installed wheel they are package data (``flightq/schemas``); in a source
    checkout they are the top-level ``schemas/`` folder beside the package.
    """
    packaged = Path(str(resources.files("flightq"))) / "schemas"
    if packaged.is_dir():
        return packaged
    source = Path(__file__).resolve().parent.parent / "schemas"
    if source.is_dir():
        return source
    raise UnknownSchemaError("flightq's shipped schemas are missing from this installation")


def check_evolution(old: Schema, new: Schema) -> None:
    """Check that ``new`` is a legal later version of ``old``.

    Raises
    ------
    EvolutionError
        Naming the field and the rule it breaks.
    """
    if old.name != new.name or new.version <= old.version:
        raise EvolutionError(f"{new.ref} is not a later version of {old.ref}")
    new_fields = list(new.fields)
    for i, f in enumerate(old.fields):
        if f.name not in new:
            raise EvolutionError(
                f"{new.ref}: field {f.name!r} of {old.ref} was removed or renamed; "
                "rule: fields are never removed or renamed (use a new schema name)",
                field=f.name,
            )
        g = new[f.name]
        if f.to_dict(with_doc=False) != g.to_dict(with_doc=False):
            changed = [
                k
                for k, v in f.to_dict(with_doc=False).items()
                if g.to_dict(with_doc=False).get(k) != v
            ] or ["codec"]
            raise EvolutionError(
                f"{new.ref}: field {f.name!r} changed its {', '.join(changed)} since {old.ref}; "
                "rule: an existing field's dtype, role, shape, required flag and codec are "
                "fixed (use a new schema name)",
                field=f.name,
            )
        if i >= len(new_fields) or new_fields[i].name != f.name:
            raise EvolutionError(
                f"{new.ref}: field {f.name!r} moved; rule: new versions only append fields",
                field=f.name,
            )
    for g in new_fields[len(old.fields) :]:
        if g.required:
            raise EvolutionError(
                f"{new.ref}: appended field {g.name!r} is required; "
                "rule: fields added in a new version are optional",
                field=g.name,
            )


class SchemaRegistry:
    """Versioned schemas by name, with the evolution rules enforced on every addition.

    Examples
    --------
    >>> reg = SchemaRegistry.default()
    >>> reg.get("rollout_vlm@1").name
    'rollout_vlm'
    """

    def __init__(self, schemas: list[Schema] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, dict[int, Schema]] = {}
        #: Schemas registered under a cap (at run time, by clients), by when each was last
        #: used, least recently first: those a full registry may forget (:meth:`forget_oldest`).
        self._added: dict[str, float] = {}
        #: Refs forgotten so, with their fingerprints: one may come back with its content only.
        self._forgotten: dict[bytes, str] = {}
        for s in sorted(schemas or [], key=lambda s: (s.name, s.version)):
            self.register(s)

    @classmethod
    def default(cls) -> SchemaRegistry:
        """A new registry holding the schemas that ship with flightq."""
        return cls.from_dir(shipped_schema_dir())

    @classmethod
    def from_dir(cls, path: str | Path) -> SchemaRegistry:
        """Load every ``<name>/v<N>.json`` under ``path``.

        Raises
        ------
        SchemaError
            If a file is malformed, misnamed, or its content disagrees with its path.
        EvolutionError
            If a version breaks the evolution rules.
        """
        root = Path(path)
        if not root.is_dir():
            raise SchemaError(f"schema folder {str(root)!r} does not exist")
        schemas: list[Schema] = []
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            for file in sorted(sub.iterdir()):
                if file.suffix != ".json":
                    continue
                m = _VERSION_FILE.match(file.name)
                if not m:
                    raise SchemaError(f"{file}: schema files are named v<N>.json")
                try:
                    s = Schema.from_json(file.read_bytes())
                except SchemaError as e:
                    raise SchemaError(f"{file}: {e}") from e
                if s.name != sub.name or s.version != int(m.group(1)):
                    raise SchemaError(
                        f"{file}: declares {s.ref} but its path says {sub.name}@{m.group(1)}"
                    )
                schemas.append(s)
        return cls(schemas)

    def register(self, schema: Schema, max_schemas: int | None = None) -> Schema:
        """Add a schema; idempotent for an identical one. With ``max_schemas``, a new one
        is refused once the registry holds that many, and is one :meth:`forget_oldest`
        may forget later (a ref forgotten so can come back with its content alone).

        Raises
        ------
        ResourceExhaustedError
            If the registry holds ``max_schemas`` already and ``schema`` is new (checked
            after everything else: a schema refused so is a valid one).
        SchemaError
            If another schema with the same name and version is registered, or was and
            was forgotten.
        EvolutionError
            If it breaks the evolution rules against its neighbouring versions.
        """
        with self._lock:
            versions = self._by_name.get(schema.name, {})
            have = versions.get(schema.version)
            forgotten = self._forgotten.get(_digest(schema.ref))
            known = forgotten if have is None else have.fingerprint
            if known is not None and known != schema.fingerprint:
                raise SchemaError(
                    f"{schema.ref} {'is already' if have else 'was'} registered with fingerprint "
                    f"{known}, not {schema.fingerprint}; released versions are immutable",
                    expected=known,
                    actual=schema.fingerprint,
                )
            if have is not None:
                self._touch(schema.ref)
                return have
            older = [v for v in versions if v < schema.version]
            newer = [v for v in versions if v > schema.version]
            if older:
                check_evolution(versions[max(older)], schema)
            if newer:
                check_evolution(schema, versions[min(newer)])
            if max_schemas is not None and sum(map(len, self._by_name.values())) >= max_schemas:
                raise ResourceExhaustedError(
                    f"cannot register {schema.ref}: the server holds {max_schemas} schemas, "
                    "its limit",
                    expected=max_schemas,
                )
            self._by_name.setdefault(schema.name, {})[schema.version] = schema
            if max_schemas is not None:
                self._added[schema.ref] = time.monotonic()
            return schema

    def forget_oldest(self, keep: set[str], idle: float = 0.0) -> Schema | None:
        """Forget the least recently used schema registered under a cap (registered again,
        looked up or checked) whose ref is not in ``keep`` (the schemas partitions use)
        and that went unused for ``idle`` seconds at least; returns it, or None where
        there is none. Schemas the registry was made with are never forgotten; a
        forgotten ref may be registered again with the same content only."""
        with self._lock:
            now = time.monotonic()
            ref = next(
                (r for r, t in self._added.items() if r not in keep and now - t >= idle), None
            )
            if ref is None:
                return None
            del self._added[ref]
            name, _, version = ref.rpartition("@")
            versions = self._by_name[name]
            gone = versions.pop(int(version))
            if not versions:
                del self._by_name[name]
            key = _digest(ref)
            self._forgotten.pop(key, None)  # the latest forgotten last
            self._forgotten[key] = gone.fingerprint
            while len(self._forgotten) > FORGOTTEN_KEPT:
                del self._forgotten[next(iter(self._forgotten))]
            return gone

    def _touch(self, ref: str) -> None:
        """Mark a schema registered under a cap as used now (the lock held)."""
        if ref in self._added:
            del self._added[ref]
            self._added[ref] = time.monotonic()

    def get(self, ref: str, version: int | None = None) -> Schema:
        """A schema by ``"name@V"``, by ``(name, V)``, or the latest version of ``name``.

        Raises
        ------
        UnknownSchemaError
            If the name or version is not registered.
        """
        name, v = parse_ref(ref, version)
        with self._lock:
            versions = self._by_name.get(name)
            if not versions:
                known = ", ".join(sorted(self._by_name)) or "(none)"
                raise UnknownSchemaError(
                    f"unknown schema {name!r}; registered: {known}",
                    expected=name if v is None else f"{name}@{v}",
                )
            if v is None:
                v = max(versions)
            elif v not in versions:
                raise UnknownSchemaError(
                    f"unknown schema version {name}@{v}; registered versions: "
                    f"{', '.join(str(x) for x in sorted(versions))}",
                    expected=f"{name}@{v}",
                )
            if self._added:
                self._touch(f"{name}@{v}")
            return versions[v]

    def names(self) -> list[str]:
        """Registered schema names, sorted."""
        with self._lock:
            return sorted(self._by_name)

    def versions(self, name: str) -> list[int]:
        """Registered versions of ``name``, ascending."""
        with self._lock:
            return sorted(self._by_name.get(name, {}))

    def __iter__(self) -> Iterator[Schema]:
        with self._lock:
            items = [s for n in sorted(self._by_name) for _, s in sorted(self._by_name[n].items())]
        return iter(items)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_name.values())

    def __contains__(self, ref: object) -> bool:
        if not isinstance(ref, str):
            return False
        try:
            self.get(ref)
        except (UnknownSchemaError, SchemaError):
            return False
        return True


def _digest(ref: str) -> bytes:
    """A forgotten ref's key: 16 bytes whatever its length."""
    return hashlib.blake2b(ref.encode("utf-8", "surrogatepass"), digest_size=16).digest()
