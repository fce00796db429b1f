"""flightq.torch.ClaimDataset feeding a torch DataLoader, against real servers and processes.

A generator process writes a W1 step; a DataLoader loop (in this process, or in worker
processes that each open their own connection) consumes it; every row is delivered once
and acknowledged once. A trainer killed mid-iteration loses nothing: its rows come back.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter

import numpy as np
import pytest
from fixtures_dataplane import (
    ROOT,
    TEXT,
    TIMEOUT,
    VLM,
    W1_TASKS,
    cli_server,
    python_env,
    run_role,
    text_columns,
    text_keys,
)
from flightq_bench import procs
from flightq_bench.flightq_system import server_argv

import flightq

pytestmark = [pytest.mark.timeout(120), pytest.mark.torch]


def _generate(location: str, partition: str) -> int:
    """Run the W1 generator role in its own process; returns the rows it put."""
    p = run_role("generator", location, partition)
    out, err = p.communicate(timeout=3 * TIMEOUT)
    assert p.returncode == 0, err
    return int(json.loads(out.strip().splitlines()[-1])["rows"])


@pytest.mark.parametrize(
    ("num_workers", "group_size", "via"),
    [(0, 16, "DataLoader"), (2, None, "DataLoader"), (2, None, "ds.loader")],
)
def test_a_dataloader_loop_consumes_a_generators_step_every_row_acked_once(
    num_workers: int, group_size: int | None, via: str
) -> None:
    from torch.utils.data import DataLoader

    from flightq.torch import ClaimDataset

    batch = group_size or 4
    with cli_server() as (location, _), flightq.connect(location, [VLM], timeout=TIMEOUT) as c:
        c.create_partition("w1", VLM, tasks=W1_TASKS, group_size=group_size)
        rows = _generate(location, "w1")
        ds = ClaimDataset(
            location,
            "w1",
            "train",
            batch,
            ["input_ids"],
            max_batches=rows // batch,
            timeout=TIMEOUT,
        )
        seen: list[str] = []
        deliveries: list[int] = []
        spawn = {"multiprocessing_context": "spawn"} if num_workers else {}
        if via == "ds.loader":
            loader = ds.loader(num_workers=num_workers)
        else:
            loader = DataLoader(ds, batch_size=None, num_workers=num_workers, **spawn)
        for b in loader:
            assert isinstance(b, flightq.Batch) and b.fields == ["input_ids"]
            if group_size:  # whole groups
                assert len({k.split("_")[0] for k in b.keys}) == 1, b.keys
            seen += b.keys
            deliveries += b.claim.deliveries
        assert Counter(seen) == Counter(list(c.list_keys("w1")))  # every row, once
        assert set(deliveries) == {1}
        assert c.inspect("w1")["acked"]["train"] == rows == 32
        ds.close()


def test_each_batch_is_acked_when_the_next_is_asked_for() -> None:
    from flightq.torch import ClaimDataset

    keys = text_keys(3, 2)
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        c.put("r", keys, text_columns(keys))
        with ClaimDataset(srv.location, "r", "train", 2, max_batches=3) as ds:
            it = iter(ds.loader())
            first = next(it)
            assert ds.current.keys == first.keys and c.inspect("r")["acked"] == {"train": 0}
            next(it)
            assert c.inspect("r")["acked"] == {"train": 2}
            assert ds.ack() == 2 and ds.current is None
            next(it)
        assert c.inspect("r")["acked"] == {"train": 6}  # leaving the block acked the last


def test_an_error_in_the_loop_gives_the_current_batch_back() -> None:
    from flightq.torch import ClaimDataset

    keys = text_keys(2, 2)
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        c.put("r", keys, text_columns(keys))
        ds = ClaimDataset(srv.location, "r", "train", 2)
        with pytest.raises(RuntimeError, match="optimizer"), ds:
            for i, _ in enumerate(ds.loader()):
                if i == 1:
                    raise RuntimeError("optimizer step failed")
        assert c.inspect("r")["acked"] == {"train": 2}  # the first; the second came back
        again = c.claim("r", "train", 2, as_="numpy", timeout=TIMEOUT)
        assert again.keys == keys[2:] and again.claim.deliveries == (2, 2)


def test_a_claim_timeout_ends_the_iteration_or_raises() -> None:
    from flightq.torch import ClaimDataset

    keys = text_keys(1, 2)
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        c.put("r", keys, text_columns(keys))
        with ClaimDataset(c, "r", "train", 2, timeout=0.2) as ds:
            assert [b.keys for b in ds.loader()] == [keys]
        assert c.inspect("r")["acked"] == {"train": 2}
        ds = ClaimDataset(c, "r", "train", 2, timeout=0.2, on_timeout="raise")
        with ds, pytest.raises(flightq.ClaimTimeoutError):
            list(ds)


def test_tensordicts_through_the_loader_carry_their_claim() -> None:
    pytest.importorskip("tensordict")
    from flightq.torch import ClaimDataset

    keys = text_keys(2, 2)
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        c.put("r", keys, text_columns(keys))
        ds = ClaimDataset(srv.location, "r", "train", 2, ["input_ids"], as_="tensordict")
        tds = []
        for td in ds.loader():
            tds.append(list(td["__key__"]))
            if len(tds) == 2:
                assert c.ack(td) == 2  # the trainer may ack itself
                break
        ds.close()
        assert tds == [keys[:2], keys[2:]] and c.inspect("r")["acked"] == {"train": 4}


def test_a_worker_started_by_fork_refuses_instead_of_hanging() -> None:
    from flightq.torch import ClaimDataset

    # The server runs in a process of its own: a fork of a process whose gRPC server
    # threads are live may die in gRPC's fork handlers before the worker's check runs.
    with procs.ServerProcess(server_argv(), "flightq") as srv:
        ds = ClaimDataset(srv.info["listening"], "r", "train", 2)
        loader = ds.loader(num_workers=1, multiprocessing_context="fork")
        with pytest.raises(ValueError, match="multiprocessing_context='spawn'"):
            next(iter(loader))


def test_a_worker_never_uses_a_client_made_before_it_started() -> None:
    from flightq.torch import ClaimDataset

    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        ds = ClaimDataset(c, "r", "train", 2)
        with pytest.raises(TypeError, match="pass the location instead"):
            next(iter(ds.loader(num_workers=1)))


def test_a_retired_workers_batches_the_trainer_still_holds_are_never_delivered_again() -> None:
    # Worker 1 starts late; worker 0 claims both batches, its next claim times out and
    # torch retires it while its second batch waits in the trainer's reorder buffer (for
    # worker 1's turn). Claimed under the worker's own session, that batch went back as
    # the worker ended, worker 1 claimed it, and the trainer trained on it twice.
    from helpers_torch_workers import slow_second_worker

    from flightq.torch import ClaimDataset

    keys = text_keys(1, 4)
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        c.put("r", keys, text_columns(keys))
        ds = ClaimDataset(srv.location, "r", "train", 2, timeout=1.0)
        with ds:
            seen = [
                (tuple(b.keys), b.claim.deliveries)
                for b in ds.loader(num_workers=2, worker_init_fn=slow_second_worker)
            ]
        assert sorted(k for ks, _ in seen for k in ks) == keys, seen  # each row once
        assert all(d == (1, 1) for _, d in seen), seen
        assert c.inspect("r")["acked"] == {"train": 4}


def test_a_sharded_loaders_workers_claim_under_the_trainers_session_on_every_shard() -> None:
    # Ending the trainer's sessions (its process gone) ends every lease, the batches the
    # workers prefetched included, on both shards: the workers claimed under them.
    from fixtures_shard import inproc_shards
    from helpers_waiting import stat_until

    from flightq.torch import ClaimDataset

    keys = text_keys(4, 2)
    with inproc_shards(2) as servers:
        locations = [s.location for s in servers]
        with flightq.connect_sharded(locations, [TEXT], timeout=TIMEOUT) as c:
            c.create_partition("r", TEXT, tasks=["train"], group_size=2)
            c.put("r", keys, text_columns(keys))
            ds = ClaimDataset(locations, "r", "train", 2, timeout=1.0)
            it = iter(ds.loader(num_workers=2, prefetch_factor=1))
            assert len(next(it).keys) == 2
            deadline = time.monotonic() + TIMEOUT
            while c.inspect("r")["leased"]["train"] < 4:  # a worker's prefetched batch too
                assert time.monotonic() < deadline, c.inspect("r")
                time.sleep(0.05)
            for shard in ds._connection().shard_clients:
                shard.session.close()
            stat_until(c, "r", "leased", {"train": 0})
            del it
            ds.nack()


def test_a_loader_goes_on_after_the_trainers_session_ended_between_epochs() -> None:
    # The link drops between epochs and the server ends the trainer's session: the
    # trainer's process opens another, and a worker given the ended one opens its own,
    # instead of every later epoch failing with NotFoundError.
    from helpers_proxy import relayed

    from flightq.torch import ClaimDataset

    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        first, second = text_keys(2, 1, "a"), text_keys(2, 1, "b")
        c.put("r", first, text_columns(first))
        with relayed(srv.location) as relay:
            ds = ClaimDataset(relay.location, "r", "train", 1, timeout=2.0)
            with ds:
                assert sorted(k for b in ds.loader(num_workers=1) for k in b.keys) == first
                ended = ds._connection().session.id()
                relay.cut()
                deadline = time.monotonic() + TIMEOUT
                while ended in srv.store._sessions:  # until the server ended it
                    assert time.monotonic() < deadline, "the server kept the session"
                    time.sleep(0.05)
                c.put("r", second, text_columns(second))
                assert sorted(k for b in ds.loader(num_workers=1) for k in b.keys) == second
        assert c.inspect("r")["acked"] == {"train": 4}


_TRAINER = """
import sys, time, flightq
from flightq.torch import ClaimDataset
ds = ClaimDataset(sys.argv[1], "r", "train", 4, timeout=3.0)
for b in ds.loader(num_workers=int(sys.argv[2])):
    print(" ".join(b.keys), flush=True)
    time.sleep(600)  # mid-step: killed here
"""


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_trainer_killed_mid_iteration_loses_no_rows(num_workers: int) -> None:
    keys = text_keys(2, 4)
    with cli_server() as (location, _), flightq.connect(location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"], lease=float("inf"))
        c.put("r", keys, text_columns(keys))
        p = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_TRAINER), location, str(num_workers)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=python_env(),
            cwd=str(ROOT),
        )
        try:
            assert p.stdout is not None
            taken = p.stdout.readline().split()
            assert len(taken) == 4, p.stderr.read() if p.stderr else ""
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        # The lease never runs out: the rows come back because the trainer's session
        # (its worker's, with num_workers=1, once the worker sees its parent gone) ended.
        back: list[str] = []
        while len(back) < len(keys):
            b = c.claim("r", "train", 4, as_="numpy", timeout=2 * TIMEOUT)
            back += b.keys
            if set(b.keys) == set(taken):
                assert b.claim.deliveries == (2,) * 4
            c.ack(b)
        assert sorted(back) == sorted(keys)
        assert c.inspect("r")["acked"] == {"train": 8}
        np.testing.assert_equal(len(set(back)), 8)
