"""NUMA placement of a rank's staging memory: run it on the CPUs of its GPU's node.

On a host of several NUMA nodes a GPU hangs off one of them (``numa_node`` of its PCI
device in sysfs). Pinned memory is placed by first touch, on the node of the CPU that
allocates it, so a rank that restricts itself to the CPUs of its GPU's node before its
first device read or put allocates its staging buffers there, and its host-to-device
copies do not cross the socket link. On a host with one node (or where sysfs says
nothing) this is a no-op that says why.

Everything reads a sysfs root given as a parameter (``/sys`` by default), so the logic is
tested on a directory tree built for the purpose.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Placement", "bus_id", "gpu_node", "nodes", "node_cpus", "place_on_gpu_node"]


@dataclass(frozen=True)
class Placement:
    """Where :func:`place_on_gpu_node` put the calling process.

    Attributes
    ----------
    node:
        The GPU's NUMA node, or None where it is not known.
    cpus:
        The CPUs the process may run on now (unchanged when ``applied`` is False).
    applied:
        Whether the CPU affinity was changed.
    reason:
        Why nothing was changed (empty when ``applied``).
    """

    node: int | None
    cpus: tuple[int, ...]
    applied: bool
    reason: str = ""


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (sysfs ``cpulist``): the CPU numbers.

    Raises
    ------
    ValueError
        If a part is neither a number nor a range ``lo-hi``.
    """
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise ValueError(f"cpulist {text.strip()!r}: {part!r} is not N or N-M")
        lo = int(m.group(1))
        out.update(range(lo, int(m.group(2) or lo) + 1))
    return out


def nodes(root: str | Path = "/sys") -> list[int]:
    """The NUMA nodes the host exposes (``[]`` where sysfs has no node directory)."""
    d = Path(root) / "devices" / "system" / "node"
    try:
        names = [p.name for p in d.iterdir()]
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"node(\d+)", n)))


def node_cpus(node: int, root: str | Path = "/sys") -> set[int]:
    """The CPUs of NUMA node ``node`` (empty if sysfs does not say)."""
    try:
        text = (Path(root) / "devices" / "system" / "node" / f"node{node}" / "cpulist").read_text()
        return parse_cpulist(text)
    except (OSError, ValueError):
        return set()


def bus_id(index: int) -> str | None:
    """The PCI address (``0000:19:00.0``) of CUDA device ``index``, as sysfs names it, or
    None where torch does not say."""
    import torch

    p = torch.cuda.get_device_properties(index)
    bus = getattr(p, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(p, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"


def gpu_node(pci: str, root: str | Path = "/sys") -> int | None:
    """The NUMA node of the PCI device ``pci`` (None: unknown, or sysfs's -1)."""
    # nvidia-smi writes an 8-digit domain (00000000:19:00.0); sysfs a 4-digit one.
    m = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])", pci.strip())
    if m is None:
        return None
    name = f"{int(m.group(1) or '0', 16):04x}:{m.group(2).lower()}"
    try:
        node = int((Path(root) / "bus" / "pci" / "devices" / name / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def place_on_gpu_node(
    pci: str | None, root: str | Path = "/sys", *, setaffinity: Any = None
) -> Placement:
    """Restrict the calling process to the CPUs of the NUMA node of the GPU at ``pci``.

    Call it before the first pinned allocation (the first device read or put of the
    process): buffers are placed on the node of the CPU that first touches them.

    Parameters
    ----------
    pci:
        The GPU's PCI address (:func:`bus_id`), or None where it is not known.
    root:
        The sysfs root to read.
    setaffinity:
        ``os.sched_setaffinity``'s signature; the default is that function (a test may
        pass a recorder to check the decision on a host where it cannot apply it).

    Returns
    -------
    Placement
        What was done, and why not where nothing was.
    """
    apply = os.sched_setaffinity if setaffinity is None else setaffinity
    now = tuple(sorted(os.sched_getaffinity(0)))
    found = nodes(root)
    if len(found) < 2:
        return Placement(None, now, False, f"{len(found) or 'no'} NUMA node(s) exposed in {root}")
    node = gpu_node(pci, root) if pci else None
    if node is None:
        return Placement(None, now, False, f"the NUMA node of GPU {pci} is not known in {root}")
    cpus = node_cpus(node, root) & set(now)
    if not cpus:
        return Placement(node, now, False, f"none of node {node}'s CPUs is allowed to this process")
    apply(0, cpus)
    return Placement(node, tuple(sorted(cpus)), True)
