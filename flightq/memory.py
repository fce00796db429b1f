"""The allocator of a flightq process: keep freed memory for the next transfer.

Every transfer over the socket lands in buffers that gRPC allocates with glibc's malloc:
the server's stored rows, a consumer's received tensors. By default glibc hands large
freed blocks back to the kernel, and the next transfer faults fresh pages in, zeroed one
by one; on the 2-core reference machine (a VM, where a first touch is expensive) that is
most of a receiver's CPU. A process that moves steps again and again is faster keeping
them.

``flightq serve`` (and shards on Ray) do both things below. A client leaves its process's
malloc alone unless asked: the setting is process-wide, so the process that embeds the
client decides (``connect(..., keep_freed_memory=True)``, or a call to
:func:`keep_freed_memory` at startup). A trainer or generator that gets step after step
and can afford to keep its high-water mark of memory should opt in.
"""

from __future__ import annotations

import os
import platform
import sys

__all__ = [
    "keep_freed_memory",
    "exec_with_one_arena",
    "collect_rarely",
    "GC_THRESHOLDS",
    "memory_cap",
    "cap_memory",
]

#: Thresholds of Python's cyclic garbage collector in a server (:func:`collect_rarely`).
GC_THRESHOLDS = (20_000, 1, 2_500)
#: Seconds a thread holds the GIL before another waiting for it takes it (Python: 0.005).
SWITCH_INTERVAL = 0.001


def keep_freed_memory() -> bool:
    """Tune glibc's allocator of this process to reuse freed memory instead of returning it.

    Blocks up to 32 MiB come from the heap, and freed memory stays there (up to 2 GiB in
    each malloc arena) for the next transfer: the process keeps its high-water mark of
    memory. The setting is process-wide and stays. glibc gives threads several arenas
    (up to 8 per core), each keeping its own freed memory: a process whose transfers run
    on many threads can hold more than its peak of live data; ``MALLOC_ARENA_MAX=1`` (or
    2) in its launch environment bounds that (``flightq serve`` starts itself so). A client
    calls this function only when asked (``connect(..., keep_freed_memory=True)``; never
    a ``shm=True`` client, whose payloads are mapped, not allocated); a process that
    embeds a server calls it at startup.

    From then on a put's payload buffers come from malloc too (:func:`flightq.sink.allocate`):
    Arrow's default pool, mimalloc, hands back the pages of a put past about half a GB
    whatever this setting says (a full W2 put, 2-core machine: 0.76 GB/s, 1.83 with this).

    Measured on the 2-core machine, a process getting full-size W2 (1.3 GB) every half
    second: 1.03-1.28 GB/s with 90-370 thousand page faults per get by default;
    1.53-1.58 GB/s with this call; 1.75-1.78 GB/s and no page faults with this call and
    ``MALLOC_ARENA_MAX=1`` in the environment. Small steps gain less: a W1 get
    (``workloads.w1(0, groups=2)``: 32 rows, 8.3 MB on the wire), 10 gets in each of 10
    fresh client processes per setting, interleaved, against one ``flightq serve``: median
    14.8 ms untuned (processes' medians 9.5-16.4 ms), 12.9 ms with this call (8.8-17.9
    ms), 1.15x, on the shared 2-core machine.

    Returns
    -------
    bool
        True when both settings took; False where glibc is absent (nothing changed) or
        refused a setting.
    """
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    try:
        # The C library this interpreter already runs on: no search for the file.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    mmap_ok = bool(mallopt(m_mmap_threshold, 32 * 2**20))
    trim_ok = bool(mallopt(m_trim_threshold, 2**31 - 1))
    if mmap_ok and trim_ok:
        from .sink import payloads_from_malloc

        payloads_from_malloc()  # a put's buffers then land in the pages malloc kept
    return mmap_ok and trim_ok


def exec_with_one_arena(argv: list[str]) -> None:
    """Start ``python -m flightq.cli *argv`` in this process again with glibc's malloc held
    to one arena, unless the environment already sets ``MALLOC_ARENA_MAX``.

    With an arena per thread (glibc's default), the blocks a server frees when rows are
    cleared stay in the arenas of the gRPC threads that received them, and the next put,
    received on other threads, grows the heap instead of reusing them: in steady state
    (put, get, clear, again) W2 held 1.7x its bytes on the 2-core machine; with one arena
    1.1x, put and get as fast (and on the 16-core host, 8 consumers as fast). glibc fixes
    the limit when a second thread first allocates, so it must be in the environment
    when the process starts. Returns only where nothing is to be done.
    """
    if sys.platform != "linux" or "MALLOC_ARENA_MAX" in os.environ or not sys.executable:
        return
    if platform.libc_ver()[0] != "glibc":
        return
    os.environ["MALLOC_ARENA_MAX"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "flightq.cli", *argv])


def collect_rarely() -> tuple[int, int, int]:
    """Run Python's cyclic garbage collector of this process rarely; returns the thresholds.

    A server holds millions of long-lived objects (three per stored row); with the default
    thresholds a put of a million rows sets off a dozen full collections, each walking
    every object held while it keeps the GIL (0.1 to 0.5 s each, every other request
    waiting). Stored rows form no reference cycles, so reference counting frees them; the
    collector is needed only for the rare cycle. It runs after 20 000 allocations instead
    of 700; the middle generation is collected every other time, so that it never holds
    more than two rounds of survivors (a collection walks what it holds: with 20 rounds
    of 50 000, a million-row put paused every request 0.1 s at a time); and a full
    collection comes after 2 500 collections of the middle generation instead of 10, about
    as rarely as before (:data:`GC_THRESHOLDS`). Also hands the GIL to a waiting thread
    after 1 ms instead of 5 (:data:`SWITCH_INTERVAL`). Process-wide: ``flightq serve`` calls it.
    """
    import gc

    gc.set_threshold(*GC_THRESHOLDS)
    # A thread waiting for the GIL behind a long Python loop (a large put being planned)
    # waits a switch interval each time it needs the GIL back: 1 ms instead of 5.
    sys.setswitchinterval(SWITCH_INTERVAL)
    return GC_THRESHOLDS


#: Times the memory budget that :func:`memory_cap` allows above the server's start (the
#: RSS promise of docs/reliability.md is 3x).
CAP_BUDGET_FACTOR = 4
#: Address space above that which the allocators reserve without using it: mimalloc
#: (Arrow's default pool) reserves arenas of 1 GiB, gRPC and Python their own.
CAP_SLACK = 2 * 2**30
#: Threads beside the calls and sessions: gRPC's pollers, the idle watch, the exporter.
CAP_SPARE_THREADS = 32


def _vm_data() -> int:
    """This process's data segment (private writable mappings), the size RLIMIT_DATA caps."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def _host_memory() -> int:
    """The memory this process may use at most: the host's, or its cgroup's if smaller."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text.isdigit():
            limit = min(limit, int(text))
    except OSError:
        pass
    return limit


def memory_cap(budget: int | None, threads: int) -> int | None:
    """The data-segment limit ``flightq serve`` sets on itself unless told otherwise.

    Arrow inflates a per-call DoPut's IPC-compressed bodies to the sizes they declare
    before the server sees them (docs/reliability.md): a few MiB of zstd can ask for more
    than the host has. Under a limit on its data segment (``RLIMIT_DATA``) that allocation
    fails at once, the put is refused with ``ResourceExhaustedError`` and the server
    serves on; without one the kernel kills a process when the pages run out. The limit:
    the data segment at the time of the call, plus :data:`CAP_BUDGET_FACTOR` times the
    memory budget (the host's memory where there is no budget), plus a thread stack for
    each of ``threads`` (calls and sessions at once) and :data:`CAP_SPARE_THREADS`, plus
    :data:`CAP_SLACK`. Returns None where Linux's ``/proc`` is absent.
    """
    if sys.platform != "linux":
        return None
    import resource

    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    if stack == resource.RLIM_INFINITY or stack <= 0:
        stack = 32 * 2**20  # glibc's thread stack when the stack limit is unlimited
    room = _host_memory() if budget is None else CAP_BUDGET_FACTOR * budget
    return _vm_data() + room + (threads + CAP_SPARE_THREADS) * stack + CAP_SLACK


def cap_memory(limit: int) -> int:
    """Limit this process's data segment to ``limit`` bytes (``RLIMIT_DATA``, soft; never
    above the hard limit); returns the limit that took. Process-wide: ``flightq serve``
    calls it for itself, a process that embeds a server decides for itself."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit
