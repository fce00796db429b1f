"""Snapshots of a server's partitions on disk, and restoring them.

A snapshot is a directory::

    manifest.json            format, creation time, and per partition: its declaration,
                             next group, row and byte counts, file names and SHA-256s
    p0.rows.arrows           Arrow IPC stream: the partition's rows in the flightq layout
                             (keys, tags, every field any row has; null where one lacks it)
    p0.state.arrows          Arrow IPC stream: per row key, its group, and per task
                             whether the row was delivered

It is written into a temporary directory next to its destination, flushed to disk, then
renamed into place, so a snapshot directory is either complete or absent. Everything is
Arrow IPC or JSON: nothing is pickled. Restoring validates every record batch against
its schema (:func:`flightq.validation.validate`) and checks every file's SHA-256.

Snapshots are written on the server's own disk, under the directory the server was
started with (``Server(snapshot_dir=...)``); a client names a snapshot, never a path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import (
    ConflictError,
    DecodeError,
    FlightqError,
    ProtocolError,
    ResourceExhaustedError,
    UnavailableError,
)
from ..schema import Schema
from .assemble import assemble
from .leases import DEFAULT_LEASE, DEFAULT_MAX_FAILURES
from .media import acquire, media_piece, row_copies
from .partition import Partition, Row
from .readings import Reading
from .store import Store

__all__ = [
    "FORMAT",
    "MANIFEST",
    "snapshot_path",
    "write_snapshot",
    "read_snapshot",
    "remove_stale",
]

#: Version of the snapshot layout.
FORMAT = 1
MANIFEST = "manifest.json"
_BATCH_BYTES = 64 * 2**20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # matched in full
_TMP = ".tmp-"


def snapshot_path(root: str | os.PathLike[str] | None, name: Any) -> Path:
    """Where snapshot ``name`` lives under ``root``.

    Raises
    ------
    ProtocolError
        If the server has no snapshot directory, or ``name`` is not a plain name
        (letters, digits, ``.``, ``_``, ``-``; no ``/``, no ``..``).
    """
    if root is None:
        raise ProtocolError(
            "snapshot: this server has no snapshot directory; start it with "
            "Server(snapshot_dir=...) or flightq serve --snapshot-dir DIR"
        )
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ProtocolError(
            f"snapshot: name {name!r} must be 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return Path(root) / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _write_ipc(path: Path, schema: pa.Schema, batches: Any) -> None:
    # The stream format, since batches may carry different dictionaries (media).
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for b in batches:
            writer.write_batch(b)
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def _state_table(p: Partition) -> pa.Table:
    rows = list(p.rows.values())
    cols: dict[str, pa.Array] = {
        "key": pa.array([r.key for r in rows], type=pa.utf8()),
        "group": pa.array([r.group for r in rows], type=pa.int64()),
    }
    for t in p.tasks:
        st = p.progress.tasks[t]
        cols[f"delivered:{t}"] = pa.array([r.key in st.done for r in rows], type=pa.bool_())
        cols[f"dead:{t}"] = pa.array([st.dead.get(r.key) for r in rows], type=pa.utf8())
        cols[f"deliveries:{t}"] = pa.array(
            [st.deliveries.get(r.key, 0) for r in rows], type=pa.int32()
        )
        cols[f"failures:{t}"] = pa.array([st.failures.get(r.key, 0) for r in rows], pa.int32())
    return pa.table(cols)


def write_snapshot(
    store: Store, path: str | os.PathLike[str], partitions: Sequence[str] | None = None
) -> dict[str, Any]:
    """Write partitions (all when None) of ``store`` to a new snapshot directory ``path``.

    The state is captured at one instant under the store's lock; the files are written
    outside it. Returns the manifest.

    Raises
    ------
    ConflictError
        If ``path`` exists already, or another snapshot of that name won the race.
    NotFoundError
        If a named partition does not exist.
    ResourceExhaustedError
        If the disk is full (the temporary directory is removed).
    UnavailableError
        If the snapshot directory cannot be written otherwise.
    """
    dest = Path(path)
    if dest.exists():
        raise ConflictError(f"snapshot {dest.name!r} exists already; choose a new name")
    # The captured rows stay counted in the budget until written, cleared or not.
    reading: list[Reading] = []
    parts = store.capture(partitions, reading)
    try:
        return _write(dest, parts)
    finally:
        for rd in reading:
            store.end_reading(rd)


def _write(dest: Path, parts: Sequence[Partition]) -> dict[str, Any]:
    """:func:`write_snapshot` of captured partitions."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}{_TMP}", dir=dest.parent))
    except OSError as e:
        raise _disk_error(dest, e) from e
    try:
        entries = []
        for i, p in enumerate(parts):
            rows = list(p.rows.values())
            present = set().union(*(r.cells for r in rows)) if rows else set()
            fields = [f.name for f in p.schema.fields if f.name in present]
            schema, batches = assemble(p, rows, fields, _BATCH_BYTES)
            rows_file, state_file = f"p{i}.rows.arrows", f"p{i}.state.arrows"
            _write_ipc(tmp / rows_file, schema, batches)
            state = _state_table(p)
            _write_ipc(tmp / state_file, state.schema, state.to_batches())
            entries.append(
                {
                    "name": p.name,
                    "schema": p.schema.canonical_json,
                    "tasks": list(p.tasks),
                    "group_size": p.group_size,
                    "max_rows": p.max_rows,
                    "next_group": p.next_group,
                    "rows": len(rows),
                    "bytes": p.nbytes,
                    "delivered": {t: len(st.done) for t, st in p.progress.tasks.items()},
                    "lease": p.lease,
                    "max_failures": p.max_failures,
                    # Oldest first: a retry after a restore is acknowledged, not stored twice.
                    "recent_puts": [[k, n] for k, n in p.recent_puts.items()],
                    "files": {"rows": rows_file, "state": state_file},
                    "sha256": {
                        rows_file: _sha256(tmp / rows_file),
                        state_file: _sha256(tmp / state_file),
                    },
                }
            )
        manifest = {"format": FORMAT, "created": time.time(), "partitions": entries}
        with open(tmp / MANIFEST, "w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.rename(tmp, dest)  # atomic: the snapshot is complete or absent
        except OSError as e:
            if dest.exists():  # another snapshot of this name was renamed in first
                raise ConflictError(
                    f"snapshot {dest.name!r} exists already; choose a new name"
                ) from e
            raise
        fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _disk_error(dest, e) from e
        raise
    return manifest


def _disk_error(dest: Path, e: OSError) -> FlightqError:
    """The typed error for a snapshot the disk refused."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhaustedError(
            f"snapshot {dest.name!r}: the disk under {str(dest.parent)!r} is full "
            f"({e.strerror}); nothing was written; free space or drop old snapshots"
        )
    return UnavailableError(
        f"snapshot {dest.name!r}: cannot write under {str(dest.parent)!r}: "
        f"{e.strerror or type(e).__name__}; nothing was written"
    )


def remove_stale(root: str | os.PathLike[str]) -> list[str]:
    """Remove the temporary directories of snapshots that never finished (a server killed
    while writing one) under ``root``; returns their names. Run at start-up, when no
    snapshot of this directory is being written."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed  # absent (created on first snapshot) or unreadable: nothing to do
    for entry in entries:
        if (
            entry.name.startswith(".")
            and _TMP in entry.name
            and entry.is_dir(follow_symlinks=False)
        ):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _read_ipc(path: Path) -> pa.Table:
    try:
        with pa.OSFile(str(path), "rb") as src:
            return pa.ipc.open_stream(src).read_all()
    except (OSError, pa.ArrowException) as e:
        raise DecodeError(f"snapshot file {path.name!r} cannot be read: {e}") from e


def _restore_partition(root: Path, e: dict[str, Any], limit: int | None) -> Partition:
    schema = Schema.from_json(e["schema"])
    files = e["files"]
    for fname, digest in e["sha256"].items():
        try:
            actual = _sha256(root / fname)
        except OSError as err:
            raise DecodeError(
                f"snapshot file {fname!r} of {e['name']!r} cannot be read: "
                f"{err.strerror or type(err).__name__}"
            ) from err
        if actual != digest:
            raise DecodeError(f"snapshot file {fname!r} is corrupt: its SHA-256 differs")
    tasks = tuple(e["tasks"])
    part = Partition(
        e["name"],
        schema,
        tasks,
        e["group_size"],
        next_group=int(e["next_group"]),
        max_rows=e.get("max_rows"),
        lease=float(e.get("lease", DEFAULT_LEASE)),
        max_failures=int(e.get("max_failures", DEFAULT_MAX_FAILURES)),
        recent_puts={str(k): int(n) for k, n in e.get("recent_puts", [])},
    )
    state = _read_ipc(root / files["state"])
    keys = state.column("key").to_pylist()
    group = dict(zip(keys, state.column("group").to_pylist(), strict=True))
    names = set(state.column_names)
    for t in tasks:
        st = part.progress.tasks[t]
        flags = state.column(f"delivered:{t}").to_pylist()
        st.done = {k for k, f in zip(keys, flags, strict=True) if f}
        # Snapshots written before claims were leases lack the columns below.
        if f"dead:{t}" in names:
            dead = state.column(f"dead:{t}").to_pylist()
            st.dead = {k: w for k, w in zip(keys, dead, strict=True) if w is not None}
        for col, into in (("deliveries", st.deliveries), ("failures", st.failures)):
            if f"{col}:{t}" in names:
                counts = state.column(f"{col}:{t}").to_pylist()
                into.update((k, n) for k, n in zip(keys, counts, strict=True) if n)
        # Rows leased when the snapshot was taken are ready again.
        st.ready = {k: None for k in keys if k not in st.done and k not in st.dead}
        # Whether rows were cleared is not in the snapshot: a group of fewer rows than the
        # group size may be a remnant.
        st.trimmed = bool(part.group_size)
    what = f"snapshot of {part.name!r}"
    for batch in _read_ipc(root / files["rows"]).to_batches():
        # Media through the partition's copies, as a put's: each distinct payload once.
        piece = media_piece(part, batch, None, what, None, max_claims_bytes=limit)
        ck = piece.checked
        batch = piece.batch
        valid = {
            f: np.asarray(batch.column(f).is_valid().to_numpy(zero_copy_only=False))
            for f in ck.fields
        }
        for i, k in enumerate(ck.keys):
            if k not in group:
                raise DecodeError(f"snapshot row {k!r} of {part.name!r} has no state")
            row = Row(
                k,
                int(group[k]),
                seq_len=int(ck.seq_lens[i]),
                nbytes=int(ck.nbytes[i]),
                held=int(piece.own[i]),
            )
            row.cells = {f: (piece, i) for f in ck.fields if valid[f][i]}
            row.tags = dict(piece.tags[i] or {})
            part.rows[k] = row
            part.nbytes += row.nbytes
            part.held += row.held
            if row.cells:
                part.use(piece, 1)
            if part.media_fields:
                acquire(part, row_copies(row, part.media_fields))
    if len(part.rows) != int(e["rows"]):
        raise DecodeError(
            f"snapshot of {part.name!r} holds {len(part.rows)} rows, its manifest says {e['rows']}"
        )
    return part


def read_snapshot(
    path: str | os.PathLike[str], max_request_bytes: int | None = None
) -> list[Partition]:
    """The partitions a snapshot directory holds, every batch validated (an object
    field's values as a put's are, against ``max_request_bytes``: the restoring server's;
    None, the default).

    Raises
    ------
    DecodeError
        If the manifest or a file is missing, corrupt, or of another format.
    """
    root = Path(path)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise DecodeError(f"{str(root)!r} is not a readable flightq snapshot: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise DecodeError(f"snapshot format {got!r} is not supported (this flightq reads {FORMAT})")
    try:
        return [_restore_partition(root, e, max_request_bytes) for e in manifest["partitions"]]
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, DecodeError):
            raise
        raise DecodeError(f"snapshot {str(root)!r} is malformed: {type(e).__name__}: {e}") from e
