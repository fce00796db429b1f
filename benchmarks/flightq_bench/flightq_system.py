"""flightq itself: ``Client.put`` of the step's rows, ``Client.get`` of them by key.

The producer passes the generator's per-row tensors as torch views (encoding is inside
the timed put); the consumer's timed get ends once every field's per-row tensors are built
(``batch[field]`` for each field, torch views); it also reports the time spent decoding
(``Batch.received``). The server runs in its own process
(``python -m flightq.cli serve --host 127.0.0.1 --port 0``).

With ``flightq bench --device cuda``: ``flightq-cuda`` puts the same rows from CUDA tensors
(moved to the GPU once, untimed) and gets them with ``device="cuda:0"``, the timed get
ending once every field's CUDA tensors are built and their copies have completed;
``h2d-pinned`` times one torch copy of the step's bytes from a pinned host buffer to the
GPU, the limit of any get into GPU memory on the machine.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from flightq.workloads import Step, to_torch

from .endpoint import Consumer, Producer, now_ns, timed
from .payload import check_flat, check_rows, flat_buffers, unpacked

__all__ = [
    "FlightqProducer",
    "FlightqConsumer",
    "FlightqGroupsProducer",
    "FlightqGroupsConsumer",
    "FlightqShmProducer",
    "FlightqShmConsumer",
    "FlightqShmNumpyProducer",
    "FlightqShmNumpyConsumer",
    "FlightqCudaProducer",
    "FlightqCudaConsumer",
    "PinnedH2DConsumer",
    "packed_taken",
    "server_argv",
    "step_on_device",
    "usable_torch",
]

#: The GPU the CUDA systems use.
DEVICE = "cuda:0"


def server_argv(host: str = "127.0.0.1") -> list[str]:
    """Command line of the flightq server process (loopback unless ``host``, free port)."""
    return [sys.executable, "-m", "flightq.cli", "serve", "--host", host, "--port", "0"]


def _partition(info: dict[str, Any], workload: str) -> str:
    return f"bench-{info['run']}-{workload}"


class FlightqProducer(Producer):
    """One ``put`` of the whole step (all groups) per repetition."""

    #: Move the bytes through shared memory (``connect(..., shm=True)``).
    shm = False
    #: Ends the partition's name: systems sharing the server never share rows.
    suffix = ""

    def setup(self) -> dict[str, Any]:
        import flightq

        self.client = flightq.connect(
            self.info["location"], schemas=[self.step.schema], shm=self.shm
        )
        self.partition = _partition(self.info, self.step.name) + self.suffix
        self.client.create_partition(
            self.partition,
            schema=self.step.schema,
            tasks=["train"],
            group_size=self.step.group_size,
        )
        return {}

    def prepare(self) -> None:
        if getattr(self, "_torch", None) is None:
            # What a generator holds: torch tensors (bfloat16 pixels as torch.bfloat16).
            # Views over the generated arrays; nothing is copied.
            self._torch = to_torch(self.step)

    def columns(self) -> Any:
        """What a put sends: the step's columns as a generator holds them."""
        return self._torch.columns

    def put(self) -> dict[str, Any]:
        s, columns = self._torch, self.columns()
        t0 = now_ns()
        self.client.put(self.partition, s.keys, columns, tags=s.tags)
        return timed(t0)

    def clear(self) -> None:
        self.client.clear(self.partition)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.drop(self.partition)
        self.client.close()


def zstd_schema(name: str, roles: tuple[str, ...], level: int = 3) -> Any:
    """Schema ``name`` (``NAME@V``) with its fields of ``roles`` compressed by zstd at
    ``level``, registered as ``<NAME>_z<roles' initials>`` (``rollout_vlm_ztm@1``)."""
    import dataclasses

    from flightq.codecs import Zstd
    from flightq.registry import SchemaRegistry
    from flightq.schema import Schema

    base = SchemaRegistry.default().get(name)
    fields = [
        dataclasses.replace(f, codec=Zstd(level)) if f.role in roles else f for f in base.fields
    ]
    tag = "".join(r[0] for r in roles)
    return Schema(f"{base.name}_z{tag}", base.version, fields, base.doc)


class FlightqZstdTokensProducer(FlightqProducer):
    """A put of the step into a partition whose token fields are zstd-compressed."""

    suffix = "-ztokens"
    roles: tuple[str, ...] = ("token",)

    def setup(self) -> dict[str, Any]:
        import flightq

        schema = zstd_schema(self.step.schema, self.roles)
        self.client = flightq.connect(self.info["location"], schemas=[self.step.schema])
        self.client.register_schema(schema)
        self.partition = _partition(self.info, self.step.name) + self.suffix
        self.client.create_partition(
            self.partition, schema=schema, tasks=["train"], group_size=self.step.group_size
        )
        return {}


class FlightqZstdProducer(FlightqZstdTokensProducer):
    """The same with token, tensor and media fields (pixel values) compressed."""

    suffix = "-zstd"
    roles = ("token", "tensor", "media")


class FlightqConsumer(Consumer):
    """``get`` by key, then every field's per-row tensors."""

    shm = False
    suffix = ""
    #: What the get hands out (``Client.get(as_=...)``).
    as_ = "torch"

    def setup(self) -> dict[str, Any]:
        import flightq

        self.client = flightq.connect(
            self.info["location"], schemas=[self.ref.schema], shm=self.shm
        )
        self.partition = _partition(self.info, self.ref.name) + self.suffix
        self._got: Any = None
        return {}

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        batch = self.client.get(self.partition, self.ref.keys, as_=self.as_)
        returned = time.perf_counter()
        cols = self.taken(batch)
        end = time.perf_counter()
        self._got = (batch, cols)
        r = batch.received
        assert r is not None
        # Decode: validating and decoding the record batches as they arrived, then joining
        # the parts' rows; its tail: what was left once the last record batch was in.
        return timed(
            t0,
            decode_s=r.decode_s + end - returned,
            decode_tail_s=end - r.arrived,
            record_batches=r.record_batches,
        )

    def taken(self, batch: Any) -> dict[str, Any]:
        """What the reader takes from the answer: every field's per-row tensors."""
        return {f: batch[f] for f in batch.fields}

    def verify(self) -> None:
        batch, cols = self._got
        check_rows(self.ref, batch.keys, cols, batch.tags, "flightq")

    def release(self) -> None:
        self._got = None

    def close(self) -> None:
        self.client.close()


class FlightqGroupsProducer(FlightqProducer):
    """A ``put`` per prompt group, as a generator writes (WORKLOADS.md's write-back
    pattern); a step without groups goes as one put."""

    suffix = "-groups"

    def put(self) -> dict[str, Any]:
        s = self._torch
        n = -(-len(s.keys) // s.group_size) if s.group_size > 1 else 1
        parts = [s.group(g) for g in range(n)] if n > 1 else [s]  # views, untimed
        t0 = now_ns()
        for p in parts:
            self.client.put(self.partition, p.keys, p.columns, tags=p.tags)
        return timed(t0)


class FlightqGroupsConsumer(FlightqConsumer):
    """``get`` of the whole step that :class:`FlightqGroupsProducer` put group by group."""

    suffix = "-groups"


class FlightqTensordictProducer(FlightqProducer):
    """``put`` of the step as a TensorDict (token fields jagged nested tensors, media rows
    a ``NonTensorStack``), what a verl or TransferQueue writer holds."""

    suffix = "-td"

    def prepare(self) -> None:
        super().prepare()
        if getattr(self, "_td", None) is None:
            from .peers import _to_tensordict

            self._td = _to_tensordict(self.step)

    def columns(self) -> Any:
        return self._td


class FlightqTensordictConsumer(FlightqConsumer):
    """``get(..., as_="tensordict")``: the TensorDict a verl or TransferQueue reader takes
    (token fields jagged over the received buffers, media rows as a ``NonTensorStack``)."""

    suffix = "-td"

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        self._got = self.client.get(self.partition, self.ref.keys, as_="tensordict")
        return timed(t0)

    def verify(self) -> None:
        from .peers import _from_tensordict

        td = self._got
        keys, tags = td["__key__"], td["__tags__"]
        keys, tags = list(keys.tolist() if hasattr(keys, "tolist") else keys), tags.tolist()
        cols = {k: v for k, v in _from_tensordict(td).items() if not k.startswith("__")}
        check_rows(self.ref, keys, cols, tags, "flightq-tensordict")


class FlightqPackedProducer(FlightqProducer):
    """``put`` of the step with every token and tensor column packed,
    ``flightq.Packed(flat, cu_seqlens)`` (packed untimed: what a packed-sequence trainer
    or generator holds); media and scalars as :class:`FlightqProducer` puts them."""

    suffix = "-packed"

    def prepare(self) -> None:
        super().prepare()
        if getattr(self, "_packed", None) is None:
            self._packed = {k: _packed(v) for k, v in self._torch.columns.items()}

    def columns(self) -> Any:
        return self._packed


def _packed(rows: Any) -> Any:
    """A column of per-row tensors as one ``flightq.Packed``; anything else as it is."""
    import torch

    import flightq

    if not isinstance(rows, list) or not rows or not all(isinstance(r, torch.Tensor) for r in rows):
        return rows
    lengths = torch.tensor([0, *(len(r) for r in rows)], dtype=torch.int64)
    return flightq.Packed(torch.cat(rows), torch.cumsum(lengths, 0).to(torch.int32))


class FlightqPackedConsumer(FlightqConsumer):
    """``get`` by key, then each token and tensor column packed, ``(flat, cu_seqlens)``
    (views of the received buffers, no tensor per row: what a packed-sequence trainer
    takes), media and scalars as :class:`FlightqConsumer` takes them."""

    suffix = "-packed"

    def taken(self, batch: Any) -> dict[str, Any]:
        return packed_taken(batch)

    def verify(self) -> None:
        batch, cols = self._got
        check_rows(self.ref, batch.keys, unpacked(cols), batch.tags, "flightq-packed")


def packed_taken(batch: Any) -> dict[str, Any]:
    """What a packed-sequence reader takes from an answer: token and tensor columns
    ``.packed()``, the rest as ``batch[name]``."""
    roles = {f: batch.schema[f].role for f in batch.fields}
    return {
        f: batch.column(f).packed() if roles[f] in ("token", "tensor") else batch[f]
        for f in batch.fields
    }


class FlightqShmProducer(FlightqProducer):
    """``put`` through shared memory: the DoPut carries a segment reference."""

    shm = True
    suffix = "-shm"


class FlightqShmNumpyProducer(FlightqShmProducer):
    """``put`` through shared memory of the generated numpy arrays (what the ``ray``
    peer puts), not torch tensors."""

    suffix = "-shmnp"

    def prepare(self) -> None:
        self._torch = self.step  # the numpy step itself: nothing converted


class FlightqShmCopyProducer(FlightqShmProducer):
    """``put`` through shared memory, the writer copying the payloads into its segment
    (``Client.shm_direct = False``): the way before direct reads, beside it in one run."""

    suffix = "-shmcopy"

    def setup(self) -> dict[str, Any]:
        out = super().setup()
        self.client.shm_direct = False
        return out


class FlightqZstdTokensConsumer(FlightqConsumer):
    """``get`` of the step from the token-compressed partition (decoded as it arrives)."""

    suffix = "-ztokens"


class FlightqZstdConsumer(FlightqConsumer):
    """``get`` of the step from the fully compressed partition."""

    suffix = "-zstd"


class FlightqShmConsumer(FlightqConsumer):
    """``get`` through shared memory: the answer names a segment the client maps."""

    shm = True
    suffix = "-shm"


class FlightqShmNumpyConsumer(FlightqShmConsumer):
    """``get(as_="numpy")`` through shared memory: numpy views of every field, what the
    ``ray`` peer hands out."""

    suffix = "-shmnp"
    as_ = "numpy"


class FlightqShmCopyConsumer(FlightqShmConsumer):
    """``get`` through shared memory of what :class:`FlightqShmCopyProducer` put."""

    suffix = "-shmcopy"


# --------------------------------------------------------------------------- CUDA


def usable_torch(script: str, device: str) -> Any:
    """torch, where it is installed and ``device`` (``"cpu"`` or ``"cuda..."``) can be used,
    once the flightq it runs with and the device are printed; else None, once ``script``
    has said why on standard error."""
    try:
        import torch
    except ImportError:
        print(f"{script}: torch is not installed", file=sys.stderr)
        return None
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{script}: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return None
    import flightq

    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else "the CPU only"
    print(f"flightq from {flightq.__file__}; {where}")
    return torch


def step_on_device(step: Step, device: str) -> Step:
    """The step's torch tensors moved to ``device`` (copies done); a group's shared image
    stays shared."""
    import torch

    memo: dict[int, Any] = {}

    def mv(t: Any) -> Any:
        if id(t) not in memo:
            memo[id(t)] = (t, t.to(device))
        return memo[id(t)][1]

    cols: dict[str, Any] = {}
    for name, col in step.columns.items():
        if isinstance(col, torch.Tensor):
            cols[name] = mv(col)
            continue
        cols[name] = [
            None if r is None else [mv(x) for x in r] if isinstance(r, list) else mv(r) for r in col
        ]
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return Step(step.name, step.schema, step.keys, cols, step.tags, step.group_size)


def _to_host(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        if not x.is_cuda:
            raise AssertionError(f"flightq-cuda: a {tuple(x.shape)} tensor is on {x.device}")
        return x.cpu()
    if isinstance(x, list):
        return [_to_host(v) for v in x]
    return x


class FlightqCudaProducer(FlightqProducer):
    """``put`` from CUDA tensors: the step lives on the GPU, as a generator's rollouts do."""

    suffix = "-cuda"

    def prepare(self) -> None:
        if getattr(self, "_torch", None) is None:
            self._torch = step_on_device(to_torch(self.step), DEVICE)


class FlightqCudaConsumer(FlightqConsumer):
    """``get(device="cuda:0")``, then every field's per-row CUDA tensors (copies done)."""

    suffix = "-cuda"

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        batch = self.client.get(self.partition, self.ref.keys, device=DEVICE)
        cols = {f: batch[f] for f in batch.fields}
        self._got = (batch, cols)
        return timed(t0)

    def verify(self) -> None:
        batch, cols = self._got
        host = {f: _to_host(v) for f, v in cols.items()}
        check_rows(self.ref, batch.keys, host, batch.tags, "flightq-cuda")


class PinnedH2DConsumer(Consumer):
    """One non-blocking copy of the step's bytes from a pinned buffer to the GPU, synced."""

    def setup(self) -> dict[str, Any]:
        import torch

        bufs = flat_buffers(self.ref)
        n = sum(len(b) for b in bufs)
        self._host: Any = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        view, off = self._host.numpy(), 0
        for b in bufs:
            view[off : off + len(b)] = b
            off += len(b)
        self._dev: Any = torch.zeros(n, dtype=torch.uint8, device=DEVICE)
        torch.cuda.synchronize(DEVICE)
        return {}

    def get(self) -> dict[str, Any]:
        import torch

        t0 = now_ns()
        self._dev.copy_(self._host, non_blocking=True)
        torch.cuda.synchronize(DEVICE)
        return timed(t0)

    def verify(self) -> None:
        check_flat(self.ref, self._dev.cpu().numpy(), "h2d-pinned")

    def release(self) -> None:
        import torch

        self._dev.zero_()
        torch.cuda.synchronize(DEVICE)

    def close(self) -> None:
        self._host = self._dev = None
