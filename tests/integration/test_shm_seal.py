"""What a sealed memfd guarantees a server that maps a writer's put (issue 17's other way).

flightq copies a put out of the writer's segment (``test_shm_hostile.py``); the way it
measured against (``benchmarks/shm_seal_cost.py``) is a Linux memfd the writer seals and
passes over a unix socket. These tests show, with the real kernel and no mocks, that once
sealed the acknowledged bytes can neither shrink nor change, whichever descriptor the
writer tries, and that sealing needs the writer's own writable mapping gone first.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import socket
from collections.abc import Callable, Iterator

import numpy as np
import pytest

SEAL_NAMES = ("F_ADD_SEALS", "F_GET_SEALS", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")


def _unavailable() -> str | None:
    if not hasattr(os, "memfd_create") or not all(hasattr(fcntl, n) for n in SEAL_NAMES):
        return "memfd sealing is Linux only (os.memfd_create, fcntl.F_ADD_SEALS missing)"
    try:
        fd = os.memfd_create("flightq-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as e:
        return f"memfd_create(MFD_ALLOW_SEALING) refused here: {e}"
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except OSError as e:
        return f"F_ADD_SEALS refused here: {e}"
    finally:
        os.close(fd)
    return None


_WHY_NOT = _unavailable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))

SIZE = 3 * mmap.PAGESIZE + 123


def _seals() -> int:
    return fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


@pytest.fixture(name="written")
def written_fixture() -> Iterator[tuple[int, bytes]]:
    """A memfd the writer filled through a shared mapping, still unsealed, and its bytes."""
    data = np.random.default_rng(17).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    fd = os.memfd_create("flightq-put", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, SIZE)
        with mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED) as mm:
            mm[:] = data
        yield fd, data
    finally:
        os.close(fd)


def _passed(fd: int) -> int:
    """``fd`` as the server gets it: over a unix socket pair, with SCM_RIGHTS."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        socket.send_fds(a, [b"put"], [fd])
        msg, fds, _, _ = socket.recv_fds(b, 64, 1)
    assert msg == b"put" and len(fds) == 1
    return fds[0]


def _refused(f: Callable[..., object], *args: object) -> None:
    with pytest.raises(PermissionError) as e:
        f(*args)
    assert e.value.errno == errno.EPERM


def test_sealing_is_refused_while_the_writer_still_maps_it_writable(
    written: tuple[int, bytes],
) -> None:
    fd, _ = written
    with mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED):
        with pytest.raises(OSError) as e:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _seals())
        assert e.value.errno == errno.EBUSY
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _seals())  # unmapped: now it seals
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _seals() == _seals()


def test_after_sealing_the_writer_can_neither_shrink_nor_change_the_acknowledged_bytes(
    written: tuple[int, bytes],
) -> None:
    fd, data = written
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _seals())
    got = _passed(fd)
    try:
        assert fcntl.fcntl(got, fcntl.F_GET_SEALS) & _seals() == _seals()
        assert os.fstat(got).st_size == SIZE
        with mmap.mmap(got, SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as acked:
            # The writer, through its own descriptor and through one opened anew by path.
            again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                for w in (fd, again):
                    _refused(os.ftruncate, w, SIZE - 1)  # F_SEAL_SHRINK
                    _refused(os.ftruncate, w, 0)
                    _refused(os.ftruncate, w, SIZE + 1)  # F_SEAL_GROW
                    _refused(os.pwrite, w, b"x", 0)  # F_SEAL_WRITE
                    _refused(os.write, w, b"x")
                    _refused(mmap.mmap, w, SIZE, mmap.MAP_SHARED)  # no writable mapping
                    _refused(fcntl.fcntl, w, fcntl.F_ADD_SEALS, 0)  # F_SEAL_SEAL: final
            finally:
                os.close(again)
            assert os.fstat(got).st_size == SIZE
            assert acked[:] == data
            assert os.pread(got, SIZE, 0) == data
    finally:
        os.close(got)


def test_the_servers_read_only_mapping_cannot_be_made_writable(
    written: tuple[int, bytes],
) -> None:
    fd, data = written
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _seals())
    got = _passed(fd)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    try:
        with mmap.mmap(got, SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as acked:
            view = np.frombuffer(acked, dtype=np.uint8)
            rw = mmap.PROT_READ | mmap.PROT_WRITE
            assert libc.mprotect(view.ctypes.data, SIZE, rw) == -1
            assert ctypes.get_errno() in (errno.EACCES, errno.EPERM)
            assert view.tobytes() == data
            del view
    finally:
        os.close(got)
