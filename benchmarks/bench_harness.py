"""The benchmark's own checks: bit-exact verification, loopback refusal, ratios, a tiny run.

These are plain tests (no timing): they show that ``flightq bench`` would notice a
corrupted delivery or a listener beyond loopback, and that a small run writes its JSON,
markdown and chart.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flightq_bench import procs
from flightq_bench.cli import main
from flightq_bench.payload import VerifyError, check_flat, check_rows, flat_buffers
from flightq_bench.stats import paired_ratio

import flightq
from flightq import SchemaRegistry, workloads


def test_check_rows_accepts_the_same_rows_and_refuses_a_flipped_bit() -> None:
    step = workloads.w2(0, groups=1)
    check_rows(step, step.keys, step.columns, step.tags, "same")
    cols = dict(step.columns)
    row = [seg.copy() for seg in cols["pixel_values"][0]]
    row[0].view(np.uint8).reshape(-1)[12345] ^= 1
    cols["pixel_values"] = [row, *cols["pixel_values"][1:]]
    with pytest.raises(VerifyError, match=r"field 'pixel_values' row 'p0_g0' segment 0: bytes"):
        check_rows(step, step.keys, cols, None, "flipped")


def test_check_flat_refuses_a_short_or_corrupted_buffer() -> None:
    step = workloads.w4(0)
    good = np.concatenate(flat_buffers(step))
    check_flat(step, good, "ok")
    bad = good.copy()
    bad[-1] ^= 0xFF
    with pytest.raises(VerifyError, match="bytes differ"):
        check_flat(step, bad, "bad")
    with pytest.raises(VerifyError, match=r"bytes differ|received"):
        check_flat(step, good[:-1], "short")


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.0.2", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
    ],
)
def test_listener_loopback_table(address: str, loopback: bool) -> None:
    assert procs.Listener(1, "tcp", address, 80).loopback is loopback


def test_check_loopback_finds_a_loopback_listener_of_this_process() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        found = procs.check_loopback([os.getpid()])
    assert any(x.port == port and x.address == "127.0.0.1" for x in found)


def test_paired_ratio_pairs_by_repetition() -> None:
    # times: a is twice as fast as b in every repetition, whatever the drift
    r = paired_ratio([1.0, 2.0, 4.0], [2.0, 4.0, 8.0], higher_is_better=False)
    assert r["median"] == 2.0 and r["min"] == 2.0 and r["max"] == 2.0 and r["n"] == 3


def test_a_tiny_run_writes_json_markdown_and_chart(tmp_path: Path) -> None:
    argv = ["--quick", "--workloads", "W4", "--systems", "memcpy,raw-tcp,pickle5"]
    argv += ["--reps", "2", "--pings", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    res = doc["workloads"]["W4"]["results"]
    assert {k: v["status"] for k, v in res.items()} == dict.fromkeys(res, "measured")
    assert all(v["verified_cycles"] >= 1 for v in res.values())
    assert "pickle5" in doc["workloads"]["W4"]["ratios"]["vs_raw-tcp"]
    md = (tmp_path / "bench.md").read_text()
    assert "## W4" in md and "command: `flightq bench --quick" in md
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bare_flight_references_move_distinct_bytes_and_flightq_records_and_check_them(
    tmp_path: Path,
) -> None:
    step = workloads.w1(0, groups=2)
    once = flat_buffers(step, distinct=True)
    assert sum(len(b) for b in once) == step.nbytes(distinct_media=True) < step.nbytes()
    refs = ["bare-flight-once", "bare-flight-records", "bare-flight-rows", "bare-flight-exchange"]
    argv = ["--quick", "--workloads", "W1", "--systems", ",".join(["raw-tcp", *refs, "flightq"])]
    argv += ["--reps", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    for ref in refs:
        # Verified: every row of the step, bit for bit (the records decoded by flightq).
        res = doc["workloads"]["W1"]["results"][ref]
        assert res["status"] == "measured" and res["verified_cycles"] >= 2, (ref, res)
        assert ref in doc["workloads"]["W1"]["ratios"]["flightq_vs"]


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed (the ray extra)"
)
def test_same_host_peers_carry_torch_and_numpy_rows_and_each_is_checked(tmp_path: Path) -> None:
    # Ray with the rows as torch tensors (what flightq carries) beside Ray with numpy
    # arrays, and flightq through shared memory with either: every row verified.
    systems = ["ray", "ray-torch", "flightq-shm", "flightq-shm-numpy"]
    argv = ["--quick", "--workloads", "W1", "--systems", ",".join(systems)]
    argv += ["--reps", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    w1 = doc["workloads"]["W1"]
    for name in systems:
        res = w1["results"][name]
        assert res["status"] == "measured" and res["verified_cycles"] >= 2, (name, res)
    assert set(w1["ratios"]["flightq-shm_vs"]) == {"ray", "ray-torch"}
    assert set(w1["ratios"]["flightq-shm-numpy_vs"]) == {"ray", "ray-torch"}
    assert "| W1 | flightq-shm-numpy | ray |" in (tmp_path / "bench.md").read_text()


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed (the ray extra)"
)
def test_the_same_host_get_benchmark_checks_ray_and_flightq_answers(capsys: Any) -> None:
    script = _script("same_host_get")
    assert script.main(["--workloads", "W4", "--reps", "2", "--modes", "off"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["workload", "zero-copy"]
    row = lines[1].split()
    assert row[:2] == ["W4", "off"] and all(float(x) > 0 for x in row[2:6])


def test_cpu_seconds_follows_this_process_cpu_clock() -> None:
    before, start = procs.cpu_seconds(), time.process_time()
    while time.process_time() - start < 0.3:  # burn CPU, not wall time
        sum(range(1000))
    assert procs.cpu_seconds() - before >= 0.2
    assert procs.cpu_seconds(2**22 + 7) == 0.0  # no such process


def test_a_run_reports_cpu_per_gb_of_writer_reader_and_server(tmp_path: Path) -> None:
    systems = "raw-tcp,flightq,flightq-groups,flightq-tensordict,flightq-packed"
    argv = ["--quick", "--workloads", "W3", "--systems", systems, "--reps", "2"]
    argv += ["--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    res = doc["workloads"]["W3"]["results"]
    # A put per prompt group lands the same rows (checked bit for bit by the get).
    # So does the same step read back as a TensorDict (keys, tags and every field), and
    # put and read with packed token columns.
    for name in ("flightq-groups", "flightq-tensordict", "flightq-packed"):
        assert res[name]["status"] == "measured" and res[name]["verified_cycles"] >= 2, name
    for name in ("raw-tcp", "flightq", "flightq-groups", "flightq-tensordict", "flightq-packed"):
        cpu = res[name]["cpu"]
        assert cpu["put"] > 0 and cpu["get"] > 0, (name, cpu)
    md = (tmp_path / "bench.md").read_text()
    assert "CPU s/GB put / get" in md
    # flightq's gets also say how long decoding took, and how much of it was left once
    # the last record batch was in (the transfer's own end is in that tail too).
    dec = res["flightq"]["decode"]
    assert dec["decode_ms"]["median"] > 0 and dec["record_batches"] >= 1
    assert 0 < dec["decode_pct"]["median"] < 100 and 0 < dec["tail_pct"]["median"] < 100
    assert "decode" not in res["raw-tcp"]
    assert "## Decode: a flightq get" in md and "| W3 | flightq | " in md


def _script(name: str) -> Any:
    """A benchmark script beside this file, loaded as a module."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_compression_benchmark_checks_both_codecs_and_prices_the_link() -> None:
    compression = _script("compression")
    r = compression.measure("W3", level=1, reps=1, quick=True)  # decoded rows compared inside
    assert r["rows"] == 16 and r["ratio"] > 1.5  # small token ids in int64 compress well
    assert r["zstd"]["bytes"] < r["raw"]["bytes"]
    be = r["breakeven_gbps"]
    assert be is not None and be > 0
    schema = compression.compressed(SchemaRegistry.default().get("rollout_text@1"), 1)
    assert schema.name == "rollout_text_zstd" and {
        f.codec.to_dict()["id"] for f in schema.fields if f.role != "scalar"
    } == {"zstd"}


def test_the_decode_floor_makes_the_tensors_a_get_returns() -> None:
    floor = _script("decode_floor")
    for name in ("W1", "W4"):
        schema, batches = floor.answer_batches(name, 16 * 2**20)
        got = flightq.decode(batches)
        made = floor.views_only(schema, batches)
        assert sorted(made) == sorted(got.fields), name
        for field in got.fields:
            want, mine = got[field], made[field]
            if schema[field].role == "scalar":
                assert torch.equal(torch.cat(mine), want), (name, field)
                continue
            if schema[field].role == "media":  # rows of segments: flatten both
                want = [s for r in want for s in r]
                mine = [s for r in mine for s in r]
            assert len(mine) == len(want) > 0, (name, field)
            for i in (0, len(want) // 2, len(want) - 1):
                assert mine[i].dtype == want[i].dtype and torch.equal(mine[i], want[i])
            assert [t.shape for t in mine] == [t.shape for t in want], (name, field)
        r = floor.measure(name, reps=3)
        assert r["record_batches"] == len(batches) and r["tensors"] > 0


def test_the_cpu_paths_benchmark_times_each_path_of_a_step(capsys: Any) -> None:
    cpu = _script("cpu_paths")
    r = cpu.measure("W4", reps=3)
    assert set(r) == {"encode", "decode", "server put", "server get"}
    assert all(v > 0 for v in r.values())
    assert cpu.main(["--workloads", "W4", "--reps", "2", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["W4"]) == set(r)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads /proc (Linux)")
def test_the_server_memory_benchmark_reads_a_real_servers_footprint_per_cycle() -> None:
    server_memory = _script("server_memory")
    base, cycles = server_memory.measure("W1", cycles=2, quick=True, per_group=True)
    assert base > 0 and len(cycles) == 2
    image = workloads.w1(0, groups=1, g=1).columns["pixel_values"][0][0].nbytes
    for cycle in cycles:
        # 2 groups stored: 2 distinct images (a group's 16 rows share one) plus text.
        assert 2 * image < cycle.held < 3 * image
        assert cycle.ratio == max(cycle.put_peak, cycle.get_peak) / cycle.held
    assert cycles[0].put_peak > cycles[0].held / 2  # the first put's rows are resident


def test_the_trainer_loop_times_both_paths_and_the_stream_carries_every_operation(
    capsys: Any,
) -> None:
    loop = _script("trainer_loop")
    server = flightq.Server()
    try:
        streamed = loop.measure(server.location, 5, False, "s")
        per_call = loop.measure(server.location, 5, True, "c")
    finally:
        server.shutdown()
    for r in (streamed, per_call):
        assert set(r["times"]) == {*loop.OPS, "loop"}
        assert all(len(v) == 5 and min(v) > 0 for v in r["times"].values())
    # Every put, claim and ack took the stream (the partition's first claim goes per
    # call: its answer's size is not known yet); per call, none did.
    assert streamed["served"] >= 3 * 5 - 1 and per_call["served"] == 0
    assert loop.main(["--loops", "3", "--reps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "stream loop p50 / per-call loop p50" in out and "per call" in out


def test_the_isolation_benchmark_runs_its_new_loads_to_their_end() -> None:
    # Imported by name, not loaded from its path: its loads run in spawned processes.
    isolation = importlib.import_module("isolation")
    base, *probes = isolation.measure(["wait-for", "put-more"], 1.0, 5000)
    assert base.load.startswith("none") and [p.load for p in probes] == ["wait-for", "put-more"]
    assert len(base.latencies) > 0
    for probe in probes:
        assert len(probe.latencies) > 0
        assert "exit" not in probe.note, probe.note  # the load's child ended cleanly


def test_the_stream_counts_benchmark_gets_and_puts_at_each_count() -> None:
    stream_counts = importlib.import_module("stream_counts")
    got = stream_counts.measure("W3", [1, 2], 1, as_="numpy")
    assert sorted(got) == [1, 2]
    assert all(len(gets) == 1 and len(puts) == 1 for gets, puts in got.values())


def test_the_read_forms_benchmark_checks_every_form_it_times(capsys: Any) -> None:
    pytest.importorskip("tensordict", reason="the tensordict forms need tensordict")
    forms = _script("read_forms")
    # W1: media rows, token fields and tags; each client checks its first answer.
    got = forms.measure("W1", ["packed", "tensordict", "numpy"], rounds=1, gets=1)
    assert sorted(f for _, f in got) == ["numpy", "packed", "tensordict"]
    assert all(len(xs) == 1 and xs[0] > 0 for xs in got.values())
    assert (
        forms.main(
            ["--workload", "W4", "--forms", "tensordict-nometa", "--rounds", "1", "--gets", "1"]
        )
        == 0
    )
    assert "tensordict-nometa" in capsys.readouterr().out
    with pytest.raises(ValueError, match="form must be one of"):
        forms.measure("W4", ["jagged"], rounds=1, gets=1)


def test_the_scaling_benchmark_times_flightq_beside_its_raw_tcp_reference(capsys: Any) -> None:
    import consumer_scaling as scaling  # by name: its consumer processes import it so

    with scaling.TcpSender(2**20) as sender:
        assert scaling.measure_tcp(sender, 2, 2) > 0  # each consumer checks its bytes
    argv = ["--consumers", "1,2", "--workload", "W4", "--gets", "1", "--reps", "1", "--raw-tcp"]
    assert scaling.main(argv) == 0
    out = capsys.readouterr().out
    assert "\nflightq\n" in out and "\nraw TCP, one sender process\n" in out
    ones = [line.split() for line in out.splitlines() if line.split()[:1] == ["1"]]
    assert [row[-1] for row in ones] == ["1.00", "1.00"]  # each table's own baseline


def test_the_scaling_benchmark_reads_through_shared_memory(capsys: Any) -> None:
    import consumer_scaling as scaling

    argv = ["--consumers", "1,2", "--workload", "W3", "--gets", "1", "--reps", "1", "--shm"]
    assert scaling.main([*argv, "--memcpy", "--populate", "--beside", "2"]) == 0  # each checks
    out = capsys.readouterr().out
    assert "gets through shared memory" in out
    assert out.count("TLB/GB") == 5  # a column of every table
    for title in (
        "flightq",
        "flightq, gets filling page tables at the map",
        "memcpy from /dev/shm, mapped for each get",
        "memcpy from /dev/shm, mapped for each get, pages on first touch",
        "memcpy from /dev/shm, mapped once",
    ):
        rows = out.split(f"\n{title}\n", 1)[1].splitlines()[1:3]
        assert [r.split()[0] for r in rows] == ["1", "2"] and rows[0].split()[-1] == "1.00"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("flightq-bench-memcpy-")]


def test_the_cuda_put_benchmark_times_every_part(capsys: Any) -> None:
    # On the CPU (--device cpu) the parts run on CPU copies: the script itself is checked,
    # its figures are not a measurement.
    pytest.importorskip("torch", reason="torch is not installed")
    import cuda_put

    assert (
        cuda_put.main(["--device", "cpu", "--workloads", "W3", "--rounds", "2", "--warmup", "0"])
        == 0
    )
    out = capsys.readouterr().out
    for part in ("put cpu", "put cuda", "stage", "encode cpu", "encode cuda"):
        assert f"  {part} " in out, part
    assert "CUDA put's speed / CPU put's:" in out


def test_the_cuda_get_benchmark_times_the_parts_a_cpu_can_run(capsys: Any) -> None:
    # On the CPU (--device cpu) the parts that need no device run (the host copy into
    # ordinary memory): the script itself is checked, its figures are not a measurement.
    pytest.importorskip("torch", reason="torch is not installed")
    import cuda_get

    argv = ["--device", "cpu", "--workloads", "W1-bf16", "--rounds", "2", "--warmup", "0"]
    assert cuda_get.main(argv) == 0
    out = capsys.readouterr().out
    for part in ("get cpu", "read", "read+check", "check", "plan", "host copy"):
        assert f"  {part} " in out, part
    assert "MiB to the device" in out
    assert "get cuda" not in out and "to device" not in out


def test_the_get_parts_benchmark_times_bare_flight_the_server_and_the_client(
    capsys: Any,
) -> None:
    parts = _script("get_parts")
    got = parts.measure("W4", "rows", rounds=2)  # the client's answer checked inside
    assert sorted(got) == ["bare", "client", "server"]  # no floor for per-row tensors
    assert all(len(xs) == 2 and min(xs) > 0 for xs in got.values())
    got = parts.measure("W4", "packed", rounds=1)  # the floor's answer checked too
    assert sorted(got) == sorted((*parts.READS, *parts.DECODES))
    assert min(min(xs) for xs in got.values()) > 0
    assert parts.main(["--workload", "W4", "--form", "packed", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "W4 get over the socket (packed)" in out and "bare / client" in out
    assert "floor / client" in out and "floor checks / client decode" in out
    with pytest.raises(ValueError, match="form must be"):
        parts.measure("W4", "jagged", rounds=1)
    with pytest.raises(ValueError, match="rounds must be"):
        parts.measure("W4", "rows", rounds=0)


def test_the_get_parts_floor_refuses_what_a_reader_must_not_take() -> None:
    import numpy as np
    import pyarrow as pa
    from flightq_bench.payload import generate

    import flightq

    parts = _script("get_parts")
    step = generate("W3", quick=True)
    schema = flightq.SchemaRegistry.default().get(step.schema)
    rb = flightq.encode(schema, step.columns, keys=step.keys, tags=step.tags)
    keys, tags, cols = parts.floor_taken(pa.Table.from_batches([rb]), schema)
    assert keys == list(step.keys) and tags == [dict(t) for t in step.tags]
    assert np.array_equal(
        cols["input_ids"].values.numpy(), np.concatenate(step.columns["input_ids"])
    )
    # One row's shape one token longer than its payload: refused, nothing handed out.
    i = rb.schema.get_field_index("input_ids__shape")
    shapes = rb.column(i).to_pylist()
    shapes[0] = [shapes[0][0] + 1]
    bad = rb.set_column(i, rb.schema.field(i), pa.array(shapes, rb.schema.field(i).type))
    with pytest.raises(ValueError, match="input_ids: a payload is not its shape's bytes"):
        parts.floor_taken(pa.Table.from_batches([bad]), schema)
    untagged = flightq.encode(schema, step.columns, keys=step.keys)  # rows without tags
    assert parts.floor_taken(pa.Table.from_batches([untagged]), schema)[1] == [{}] * len(rb)
    with pytest.raises(ValueError, match="row keys are not unique"):
        twice = pa.Table.from_batches([rb]).set_column(0, "__key__", pa.array(["k"] * len(rb)))
        parts.floor_taken(twice, schema)


def test_the_server_trees_benchmark_checks_and_times_each_servers_reads(capsys: Any) -> None:
    trees = _script("server_trees")
    # Two servers of this tree: W4's prompt groups, claimed through shared memory, and a
    # get over the socket; each client's first reads are checked against the step.
    got = trees.measure([".", "."], "W4", mode="claim", shm=True, rounds=2, gets=1)
    assert [t for t, _, _ in got] == [".", "."]
    assert all(len(reads) == 2 and reads[0][0] > 0 for _, reads, _ in got)
    assert all(len(puts) == 2 and puts[0][0] > 0 for _, _, puts in got)  # put again each time
    assert trees.main(["--trees", ".,.", "--workload", "W4", "--rounds", "1", "--gets", "1"]) == 0
    out = capsys.readouterr().out
    assert "W4 get as numpy over socket" in out and "put" not in out  # the same step read
    argv = ["--trees", ".", "--workload", "W4", "--rounds", "1", "--gets", "2", "--fresh"]
    assert trees.main([*argv, "--shm"]) == 0
    out = capsys.readouterr().out
    assert "each a fresh step's first" in out and "W4 put over shm" in out
    with pytest.raises(ValueError, match="mode must be"):
        trees.measure(["."], "W4", mode="scan")
