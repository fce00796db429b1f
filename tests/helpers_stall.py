"""A writer whose memory stalls every reader: run as a script by test_shm_direct.

``python helpers_stall.py LOCATION SHM_DIR [put|probe]`` maps anonymous memory,
registers it with userfaultfd and never serves a fault, so any read of it (the server's
``process_vm_readv`` included) waits until this process goes. ``put`` (the default)
then makes a W1 put through shared memory whose image fill points into that memory and
prints one JSON line (``{"refused": message, "nbytes": segment's bytes}``, ``{"stored": rows}`` or
``{"skip": why}``); ``probe`` sends a shared-memory probe whose token lies there and
prints the server's ``shm`` health entry and the seconds it took (``{"shm", "s"}``).
Either way it then sleeps until it is killed.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time
from typing import Any

import msgpack
import numpy as np
import pyarrow.flight as fl
from helpers_reliability import plain_shm_put

import flightq
from flightq import workloads
from flightq.chunks import encode_chunks
from flightq.protocol import Health
from flightq.shm.gather import gathering
from flightq.shm.segments import BATCH_BYTES, SegmentPool

SIZE = 8 * 2**20
_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_UFFDIO_API = 0xC018AA3F
_UFFDIO_REGISTER = 0xC020AA00
_UFFD_API = 0xAA
_MODE_MISSING = 1


def _stalling_memory() -> tuple[mmap.mmap, int] | str:
    """Anonymous memory whose missing pages no one serves, or why there is none."""
    number = _SYS_USERFAULTFD.get(os.uname().machine)
    if number is None:
        return f"no userfaultfd syscall number known for {os.uname().machine}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    uffd = libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK)
    if uffd < 0:
        return f"userfaultfd: {os.strerror(ctypes.get_errno())}"
    api = (ctypes.c_uint64 * 3)(_UFFD_API, 0, 0)
    if libc.ioctl(uffd, ctypes.c_ulong(_UFFDIO_API), api) != 0:
        return f"UFFDIO_API: {os.strerror(ctypes.get_errno())}"
    reg = (ctypes.c_uint64 * 4)(addr, SIZE, _MODE_MISSING, 0)
    if libc.ioctl(uffd, ctypes.c_ulong(_UFFDIO_REGISTER), reg) != 0:
        return f"UFFDIO_REGISTER: {os.strerror(ctypes.get_errno())}"
    return m, addr


def direct_segment(shm_dir: str, step: workloads.Step) -> tuple[SegmentPool, dict[str, Any], bytes]:
    """A writer's segment of ``step`` with its large payloads left out, and the fills naming
    them in this process's memory (valid while ``step`` lives)."""
    pool = SegmentPool(shm_dir)
    schema = flightq.SchemaRegistry.default().get(step.schema)
    with gathering() as g:
        batches = encode_chunks(
            schema, step.columns, step.keys, step.tags, max_bytes=BATCH_BYTES, sink=g
        )
        g.direct = True
        ref = pool.write(batches[0].schema, batches, "test put", g)
        assert g.fills is not None
        return pool, ref, g.fills


def main(location: str, shm_dir: str, mode: str = "put") -> None:
    got = _stalling_memory()
    if isinstance(got, str):
        print(json.dumps({"skip": got}), flush=True)
        return
    _, addr = got
    if mode == "probe":
        _probe(location, shm_dir, addr)
        return
    step = workloads.w1(groups=1, g=2)
    _, ref, raw = direct_segment(shm_dir, step)
    fills = np.frombuffer(raw, dtype="<i8").reshape(-1, 3).copy()
    big = int(np.argmax(fills[:, 2]))
    assert fills[big, 2] <= SIZE
    fills[big, 1] = addr  # the image's bytes: memory no one will serve
    try:
        plain_shm_put(location, {**ref, "pid": os.getpid(), "fills": fills.tobytes()}, rows=2)
        print(json.dumps({"stored": 2}), flush=True)
    except fl.FlightError as e:
        print(json.dumps({"refused": str(e), "nbytes": ref["nbytes"]}), flush=True)
    time.sleep(300)  # keeps the memory registered until killed


def _probe(location: str, shm_dir: str, addr: int) -> None:
    """A shared-memory probe whose token the server must read from stalling memory."""
    path = os.path.join(shm_dir, f"flightq-{os.getpid()}-5ea11ed0-0")
    with open(path, "wb") as f:
        f.write(os.urandom(32))
    client = fl.connect(location)
    started = time.monotonic()
    body = Health(shm_probe=path, shm_reader=[os.getpid(), addr]).to_wire()
    (res,) = list(client.do_action(fl.Action("health", body)))
    took = time.monotonic() - started
    print(json.dumps({"shm": msgpack.unpackb(res.body.to_pybytes())["shm"], "s": took}), flush=True)
    time.sleep(300)  # keeps the memory registered until killed


if __name__ == "__main__":
    main(*sys.argv[1:])
