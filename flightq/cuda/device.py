"""CUDA devices: where a read lands, and the dtype and alignment rules of staging buffers
(the pinned buffers themselves: :mod:`flightq.cuda.pinned`).

torch is imported inside the functions that need it: a CPU-only process never loads it
through this package.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import DTYPES
from ..errors import DeviceError

#: Byte alignment of every tensor inside a staging buffer (covers every dtype and
#: the vector loads of device kernels).
ALIGN = 256


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
