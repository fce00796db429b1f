"""CUDA tensors in and out of the data plane: pinned staging, side streams, async copies.

Puts: the CUDA tensors of a put are copied device-to-host into one reusable pinned buffer
on a side stream (one async copy per distinct tensor, in row order), with an event every
few MiB; each record batch is encoded once the copies of its rows are done (one
synchronize per chunk), while later rows are still being copied. The wire format is the
CPU path's, byte for byte.

Gets and claims with ``device="cuda:N"``: the DoGet streams are read as the CPU get reads
them, each record batch checked as it arrives; once they ended, every payload is copied
once into pinned memory (on a few threads)
and crosses to the device in one non-blocking copy per window of pinned memory on a side
stream. The result is a :class:`DeviceBatch` whose columns yield CUDA tensors (bf16 and fp8
included) viewing one device buffer per get.

torch is imported inside the functions that need it: a CPU-only process never loads it
through this package (:mod:`~flightq.cuda.device`: devices; :mod:`~flightq.cuda.pinned`: the pinned
pool and the process's cap on it (``FLIGHTQ_PINNED_LIMIT``, 4 GiB by default);
:mod:`~flightq.cuda.put`: staging a put; :mod:`~flightq.cuda.get`: reads into device memory).
"""

from .device import resolve_device
from .get import DeviceBatch, decode_streams_to_device, decode_to_device
from .get import rebase as rebase
from .pinned import PinnedPool, pinned_held, pinned_limit, set_pinned_limit
from .put import Staged, has_cuda, stage

__all__ = [
    "PinnedPool",
    "pinned_held",
    "pinned_limit",
    "set_pinned_limit",
    "DeviceBatch",
    "Staged",
    "resolve_device",
    "has_cuda",
    "stage",
    "decode_to_device",
    "decode_streams_to_device",
]
