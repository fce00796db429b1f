"""flightq.Writer: a generator's puts in the background, against a real server.

Many puts land, in order, each once; a full queue blocks and then raises a typed error;
an error in the background surfaces on the next put, on flush and on close, and nothing
queued after it is stored; a put id repeated (a retry) stores nothing again.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, text_columns, text_keys

import flightq

pytestmark = pytest.mark.timeout(120)


def _rows(n: int, prefix: str) -> tuple[list[str], dict[str, object]]:
    keys = text_keys(1, n, prefix)
    return keys, text_columns(keys)


def test_many_puts_land_once_each_and_close_flushes() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        w = flightq.Writer(srv.location, "r", max_pending=4)
        ids = [w.put(*_rows(2, f"p{i}_")) for i in range(200)]
        w.close()  # flushes
        assert len(set(ids)) == 200 and (w.puts, w.rows, w.dropped) == (200, 400, 0)
        assert c.inspect("r")["rows"] == 400
        with pytest.raises(ValueError, match="closed"):
            w.put(*_rows(1, "late"))


def test_a_full_queue_blocks_then_raises_a_typed_error() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"], max_rows=2)
        with flightq.Writer(c, "r", max_pending=1) as w:
            w.put(*_rows(2, "a"))  # fills the partition
            w.put(*_rows(2, "b"))  # sent: the server waits for room
            time.sleep(0.3)
            w.put(*_rows(2, "c"))  # queued: the queue is full now
            start = time.monotonic()
            with pytest.raises(flightq.WriterFullError, match="max_pending=1") as e:
                w.put(*_rows(2, "d"), timeout=0.3)
            assert time.monotonic() - start >= 0.3 and isinstance(e.value, TimeoutError)
            # A trainer makes room (clears what it consumed): the writer moves on.
            done = threading.Event()

            def trainer() -> None:
                while not done.is_set():
                    c.clear("r")
                    time.sleep(0.05)

            t = threading.Thread(target=trainer)
            t.start()
            try:
                w.put(*_rows(2, "e"), timeout=TIMEOUT)
                w.flush()
            finally:
                done.set()
                t.join()
        assert w.puts == 4 and w.dropped == 0


def test_an_error_in_the_background_surfaces_on_put_flush_and_close() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        w = flightq.Writer(c, "r", max_pending=8)
        w.put(*_rows(2, "ok"))
        w.put(["bad_g0"], {"input_ids": [np.arange(3, dtype=np.float32)]})
        w.put(*_rows(2, "after"))  # may be queued or refused: never stored
        with pytest.raises(flightq.DTypeError, match="input_ids"):
            w.flush()
        with pytest.raises(flightq.DTypeError, match="input_ids"):
            w.put(*_rows(2, "later"))
        with pytest.raises(flightq.DTypeError, match="input_ids"):
            w.close()
        assert sorted(c.list_keys("r")) == ["ok0_g0", "ok0_g1"]
        assert w.puts == 1 and w.dropped <= 1


def test_a_repeated_put_id_stores_nothing_again() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        keys, cols = _rows(2, "p")
        with flightq.Writer(c, "r") as w:
            put_id = w.put(keys, cols)
        # What a retry of that put sends: the same id; acknowledged, nothing stored twice.
        assert c.put("r", keys, cols, put_id=put_id) == 2
        assert c.inspect("r")["rows"] == 2
