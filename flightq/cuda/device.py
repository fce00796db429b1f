"""CUDA devices and pinned host memory: where a read lands, and the reusable pinned
buffers and side streams that puts and gets copy through.

torch is imported inside the functions that need it: a CPU-only process never loads it
through this package.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..dtypes import DTYPES
from ..errors import DeviceError

#: Byte alignment of every tensor inside a staging buffer (covers every dtype and
#: the vector loads of device kernels).
ALIGN = 256
#: Pinned buffers are allocated in multiples of this.
_GRAIN = 2**20


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def numpy_dtype(torch_dtype: Any) -> np.dtype | None:
    """The numpy dtype holding a torch dtype's values, None for bf16, fp8 and the unknown."""
    dt = DTYPES.get(str(torch_dtype).removeprefix("torch."))
    return dt.storage if dt is not None and dt.native_numpy else None


def torch_module() -> Any:
    """The torch module, or a DeviceError saying it is not installed."""
    try:
        import torch
    except ImportError as e:
        raise DeviceError(
            "CUDA tensors need torch with CUDA (pip install 'flightq[torch]'); "
            "pass device=None to read CPU tensors"
        ) from e
    return torch


# --------------------------------------------------------------------------- devices


def resolve_device(device: Any, as_: str = "torch") -> Any:
    """The CUDA device a read should land on, or None for the CPU paths.

    Parameters
    ----------
    device:
        None or ``"cpu"`` (the CPU path), ``"cuda"``, ``"cuda:N"``, an int ``N`` or a
        ``torch.device``.
    as_:
        The read's ``as_``: CUDA tensors exist only as torch.

    Returns
    -------
    torch.device or None
        ``cuda:N`` with an explicit index, or None for the CPU.

    Raises
    ------
    DeviceError
        (also a ``RuntimeError``) if the string names no device, the device is not CUDA,
        torch or CUDA is missing here, the index is out of range, or ``as_='numpy'``.

    Examples
    --------
    >>> resolve_device(None) is None and resolve_device("cpu") is None
    True
    """
    if device is None or (isinstance(device, str) and device.strip().lower() == "cpu"):
        return None
    torch = torch_module()
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise DeviceError(
            f"device={device!r} names no device; expected None, 'cpu', 'cuda' or 'cuda:N'"
        ) from e
    if d.type == "cpu":
        return None
    if d.type != "cuda":
        raise DeviceError(
            f"device={device!r}: flightq reads into 'cpu' or 'cuda[:N]', not {d.type!r}"
        )
    if as_ != "torch":
        raise DeviceError(
            f"device={device!r} returns torch tensors; as_={as_!r} is for CPU reads, "
            "pass as_='torch' or device=None"
        )
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device={device!r} asked for, but CUDA is not available here (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}); pass device=None "
            "for CPU tensors, or install a CUDA build of torch on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if d.index is None else d.index
    if not 0 <= index < count:
        raise DeviceError(f"device={device!r}: this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


# --------------------------------------------------------------------------- pinned pool


class PinnedPool:
    """Reusable pinned host buffers and one copy stream per device, owned by one client.

    A buffer handed back with :meth:`give` may still be the source or target of copies in
    flight: it carries their events and is only handed out again once they completed.
    Thread-safe. Nothing is allocated (and torch is not imported) before the first use.

    Parameters
    ----------
    max_cached_bytes:
        Free buffers kept beyond this are released to torch's host allocator.
    """

    def __init__(self, max_cached_bytes: int = 2**30) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._lock = threading.Lock()
        self._free: list[tuple[Any, list[Any]]] = []
        self._streams: dict[int, Any] = {}
        #: Pinned bytes allocated so far (new buffers only; reuse does not count).
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> Any:
        """A pinned 1-D uint8 CPU tensor of at least ``nbytes`` bytes, idle."""
        torch = torch_module()
        with self._lock:
            fits = [(b, ev) for b, ev in self._free if b.numel() >= nbytes]
            # Prefer an idle buffer, then the smallest: large ones stay for large puts.
            fits.sort(key=lambda x: (not all(e.query() for e in x[1]), x[0].numel()))
            if fits:
                buf, events = fits[0]
                self._free = [x for x in self._free if x[0] is not buf]
            else:
                buf, events = None, []
        for e in events:
            e.synchronize()
        if buf is None:
            size = max(_GRAIN, (nbytes + _GRAIN - 1) // _GRAIN * _GRAIN)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            with self._lock:
                self.allocated_bytes += size
        return buf

    def give(self, buf: Any, events: Iterable[Any] = ()) -> None:
        """Hand ``buf`` back; it is reused once every event in ``events`` has completed."""
        with self._lock:
            self._free.append((buf, list(events)))
            while sum(b.numel() for b, _ in self._free) > self.max_cached_bytes:
                self._free.sort(key=lambda x: x[0].numel())
                old, evs = self._free.pop(0)
                for e in evs:
                    e.synchronize()
                del old

    def stream(self, device: Any) -> Any:
        """The side stream this pool copies on for ``device`` (a ``torch.device``)."""
        torch = torch_module()
        with self._lock:
            s = self._streams.get(device.index)
            if s is None:
                s = torch.cuda.Stream(device=device)
                self._streams[device.index] = s
        return s

    def clear(self) -> None:
        """Release every free buffer (those in use stay with their holders)."""
        with self._lock:
            free, self._free = self._free, []
        for _, evs in free:
            for e in evs:
                e.synchronize()
