"""The asyncio client against a real server: same methods, same results, same errors."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import subprocess
import sys
import time

import numpy as np
import pytest
from fixtures_dataplane import (
    TEXT,
    TIMEOUT,
    VLM,
    raw,
    server_fixture,  # noqa: F401
    text_columns,
    text_keys,
)
from helpers_waiting import stat_until, stat_until_async

import flightq
import flightq.aio

pytestmark = pytest.mark.timeout(60)


def run(coro):
    """Run one coroutine on a fresh event loop, bounded."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@pytest.mark.torch
def test_async_client_puts_gets_claims_clears(server):
    keys = text_keys(2, 4)
    cols = text_columns(keys)

    async def main():
        async with await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
            assert isinstance(c, flightq.aio.AsyncClient)
            assert await c.create_partition("p", TEXT, tasks=["train"], group_size=4) is True
            assert await c.put("p", keys, cols, [{"prompt_idx": i} for i in range(8)]) == 8
            got = await c.get("p", ["p1_g3", "p0_g0"], ["input_ids"], as_="numpy")
            hid = await c.get("p", ["p0_g1"], [], as_="numpy", hide_tag_values="prompt")
            claimed = await c.claim("p", "train", 4, timeout=TIMEOUT, hide_tag_values="prompt")
            assert await c.reset("p", "train") == 4
            stats = await c.stats()
            described = await c.inspect("p")
            names = await c.partitions()
            assert await c.clear("p", ["p0_g0", "nope"], missing_ok=True) == 1
            cleared = await c.clear("p")
            return got, hid, claimed, stats, described, names, cleared

    got, hid, claimed, stats, described, names, cleared = run(main())
    assert got.keys == ["p1_g3", "p0_g0"]
    assert hid.tags == [{"prompt_idx": None}]
    assert raw(got["input_ids"][0]) == raw(cols["input_ids"][7])
    assert claimed.keys == keys[:4] and claimed.tags == [{"prompt_idx": None}] * 4
    assert stats["partitions"]["p"]["rows"] == 8
    assert described["delivered"] == {"train": 0}
    assert names == ["p"]
    assert cleared == 7


@pytest.mark.torch
def test_an_awaited_claim_leaves_the_loop_free_to_put(server):
    keys = ["a0", "a1"]

    async def main():
        async with await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
            await c.create_partition("p", TEXT, tasks=["train"])
            claim = asyncio.ensure_future(c.claim("p", "train", 2, timeout=TIMEOUT))
            # The loop turns (this stats poll runs) while the claim waits on the server.
            await stat_until_async(c, "p", "waiting", {"train": 1})
            assert not claim.done()
            await c.put("p", keys, text_columns(keys))
            return await claim

    assert run(main()).keys == keys


def test_claims_cancelled_while_they_wait_stop_on_the_server_and_free_their_threads(server):
    # asyncio.wait_for cancels claims that wait; each went on waiting in its pool thread
    # for its whole timeout, so that after four of them (the pool's threads) a put waited
    # 19.8 s. Now each cancelled claim is stopped on the server at once.
    keys = text_keys(2, 4)

    async def main():
        async with await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
            await c.create_partition("p", TEXT, tasks=["train"])
            for _ in range(6):  # more than the pool's 4 threads
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(c.claim("p", "train", 4, as_="numpy", timeout=50), 0.3)
            await stat_until_async(c, "p", "waiting", {"train": 0})
            await asyncio.wait_for(c.put("p", keys, text_columns(keys)), TIMEOUT / 2)
            got = await c.claim("p", "train", 8, as_="numpy", timeout=TIMEOUT)
            assert sorted(got.keys) == sorted(keys)
            assert got.claim.deliveries == (1,) * 8  # no cancelled claim took them
            assert await c.ack(got) == 8
            return await c.inspect("p")

    described = run(main())
    assert described["delivered"] == {"train": 8} and described["acked"] == {"train": 8}


def test_an_explicit_cancel_is_not_queued_behind_the_claims_filling_the_pool(server):
    # cancel_claim ran on the pool, whose threads the waiting claims held: it waited
    # behind them for their whole timeout.
    async def main():
        async with await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
            await c.create_partition("p", TEXT, tasks=["train"])
            names = [f"c{i}" for i in range(4)]  # the pool's 4 threads
            claims = [
                asyncio.ensure_future(c.claim("p", "train", 1, as_="numpy", timeout=50, call_id=n))
                for n in names
            ]
            # (The pool is full: the stats come from a client of their own.)
            with flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as watcher:
                await asyncio.to_thread(stat_until, watcher, "p", "waiting", {"train": 4})
            for n in names:
                assert await asyncio.wait_for(c.cancel_claim("p", n), TIMEOUT / 2) == 1
            for claim in claims:
                with pytest.raises(flightq.ClaimCancelledError):
                    await claim

    run(main())


def test_a_claim_whose_cancel_never_reaches_the_server_gives_back_the_rows_it_takes(
    server, monkeypatch
):
    # The cancel lost on its way (the link dropped as it went): the claim goes on
    # waiting in its thread, and the rows it then takes are given back at once.
    monkeypatch.setattr(flightq.aio.AsyncClient, "_cancel", lambda self, p, call: None)
    keys = text_keys(2, 4)

    async def main():
        async with await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
            await c.create_partition("p", TEXT, tasks=["train"])
            for _ in range(2):
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(c.claim("p", "train", 4, as_="numpy"), 0.3)
            await stat_until_async(c, "p", "waiting", {"train": 2})  # still in their threads
            await c.put("p", keys, text_columns(keys))
            await stat_until_async(c, "p", "waiting", {"train": 0})
            await stat_until_async(c, "p", "leased", {"train": 0})  # given back
            got = await c.claim("p", "train", 8, as_="numpy", timeout=TIMEOUT)
            assert sorted(got.keys) == sorted(keys)
            assert await c.ack(got) == 8
            return await c.inspect("p")

    described = run(main())
    assert described["dead"] == {"train": 0} and described["acked"] == {"train": 8}


def test_a_claim_cancelled_after_its_client_closed_ends_cancelled(server):
    # The usual shutdown order (leave `async with`, then cancel the tasks left): the
    # cancel could not be sent, and the task raised RuntimeError ("cannot schedule new
    # futures after shutdown") instead of CancelledError.
    async def main():
        c = await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT)
        await c.create_partition("p", TEXT, tasks=["train"])
        task = asyncio.ensure_future(c.claim("p", "train", 1, as_="numpy", timeout=5))
        await stat_until_async(c, "p", "waiting", {"train": 1})
        await c.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_a_program_leaving_async_with_while_a_claim_waits_exits_at_once(server):
    # asyncio.run cancelled the pending claim after the client closed; the claim went on
    # in its pool thread, and the interpreter waited for that thread at exit: the
    # claim's whole timeout (15 s of 15, measured), however long.
    script = f"""
import asyncio, flightq.aio
async def main():
    async with await flightq.aio.connect({server.location!r}, [{TEXT!r}]) as c:
        asyncio.ensure_future(c.claim("p", "train", 1, as_="numpy", timeout=120))
        while (await c.inspect("p"))["waiting"] != {{"train": 1}}:
            await asyncio.sleep(0.01)
asyncio.run(main())
print("returning", flush=True)
"""
    with flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
        c.create_partition("p", TEXT, tasks=["train"])
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100
    )
    took = time.monotonic() - started
    assert done.returncode == 0 and "returning" in done.stdout, done.stderr[-2000:]
    assert took < 60, f"the process took {took:.1f} s to exit (its claim waits 120 s)"


def test_async_errors_are_the_same_typed_errors(server):
    async def main():
        async with await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
            await c.create_partition("p", TEXT, tasks=["train"])
            with pytest.raises(flightq.NotFoundError, match=r"unknown partition 'nope'"):
                await c.get("nope", ["k"])
            with pytest.raises(flightq.NotFoundError, match=r"has no row key 'k9'"):
                await c.get("p", ["k9"])
            with pytest.raises(flightq.ClaimTimeoutError, match=r"timed out after 0.2s") as exc:
                await c.claim("p", "train", 1, as_="numpy", timeout=0.2)
            assert isinstance(exc.value, TimeoutError)
            await c.put("p", ["k0"], text_columns(["k0"]))
            with pytest.raises(flightq.ConflictError, match=r"already has column 'input_ids'"):
                await c.put("p", ["k0"], {"input_ids": [np.arange(3)]})

    run(main())


def test_async_connect_fails_on_a_schema_drift(server):
    v = flightq.SchemaRegistry.default().get(VLM)
    drift = flightq.Schema(
        v.name,
        v.version,
        [dataclasses.replace(f, dtype="int64") if f.name == "imgs_sizes" else f for f in v.fields],
    )
    with pytest.raises(
        flightq.SchemaMismatchError,
        match=r"'imgs_sizes': dtype yours 'int64', the server's 'int32'",
    ):
        run(flightq.aio.connect(server.location, [drift], timeout=TIMEOUT))


def test_async_client_has_every_method_of_the_client(server):
    public = {
        n
        for n in vars(flightq.Client)
        if not n.startswith("_") and callable(getattr(flightq.Client, n))
    }

    async def main():
        c = await flightq.aio.connect(server.location, timeout=TIMEOUT)
        try:
            return {n for n in public if inspect.iscoroutinefunction(getattr(c, n, None))}
        finally:
            await c.close()

    assert run(main()) == public
