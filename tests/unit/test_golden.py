"""Golden streams: released bytes decode to the recorded values and re-encode identically.

The files under ``tests/golden/`` were written once by ``tests/golden/make_golden.py``
and are never rewritten. If a test here fails after a code change, the change altered the
wire format: revert it, or release a new schema version with a new golden file.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from helpers_wire import SHIPPED_REFS, read_ipc, shipped

import flightq
from flightq.layout import META_FINGERPRINT, META_SCHEMA, schema_of

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"

# Part of the wire contract: a schema file edited after release changes its fingerprint.
FINGERPRINTS = {
    "rollout_text@1": "8fc8fc254357e2fa",
    "rollout_vlm@1": "d7a5042c77355bdd",
    "rollout_vlm_bf16@1": "67f08417fecfdc87",
}


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN_DIR / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_golden = _load_generator()


def _golden(ref: str) -> tuple[bytes, dict[str, Any]]:
    stream, expected = make_golden.paths(ref)
    return stream.read_bytes(), json.loads(expected.read_text())


def test_every_shipped_schema_version_has_a_pinned_fingerprint() -> None:
    reg = flightq.SchemaRegistry.default()
    assert {s.ref: s.fingerprint for s in reg} == FINGERPRINTS


def test_every_shipped_schema_version_has_a_golden_stream() -> None:
    assert set(make_golden.GOLDEN) == set(FINGERPRINTS) == set(SHIPPED_REFS)
    for ref in FINGERPRINTS:
        stream, expected = make_golden.paths(ref)
        assert stream.is_file() and expected.is_file(), f"{ref}: run tests/golden/make_golden.py"


@pytest.mark.parametrize("ref", FINGERPRINTS)
def test_golden_stream_carries_the_pinned_schema(ref: str) -> None:
    data, want = _golden(ref)
    rb = read_ipc(data)
    meta = rb.schema.metadata
    assert meta[META_FINGERPRINT].decode() == FINGERPRINTS[ref] == want["fingerprint"]
    assert meta[META_SCHEMA].decode() == shipped(ref).canonical_json
    assert schema_of(rb.schema) == shipped(ref)


def _values(t: Any) -> list[Any]:
    """Flat values, floats as repr strings so that -0.0 and 0.0 differ."""
    import torch

    flat = (t if isinstance(t, torch.Tensor) else torch.from_numpy(t)).reshape(-1)
    if flat.dtype.is_floating_point:
        return [repr(v) for v in flat.to(torch.float64).tolist()]
    return flat.tolist()


def _want_values(values: list[Any], dtype: str) -> list[Any]:
    return [repr(float(v)) for v in values] if "float" in dtype else values


def _assert_row(got: Any, want: dict[str, Any], dtype: str) -> None:
    assert list(got.shape) == want["shape"]
    assert str(got.dtype).removeprefix("torch.") == dtype
    assert _values(got) == _want_values(want["values"], dtype)


@pytest.mark.torch
@pytest.mark.parametrize("ref", FINGERPRINTS)
def test_golden_stream_decodes_to_the_recorded_values(ref: str) -> None:
    data, want = _golden(ref)
    out = flightq.decode(read_ipc(data))
    assert out.schema.ref == want["schema"] == ref
    assert out.keys == want["keys"]
    assert out.tags == want["tags"]
    assert out.fields == list(
        f.name for f in shipped(ref) if f.name in want["fields"]
    )  # schema order
    for name, spec in want["fields"].items():
        rows, dtype = out[name], spec["dtype"]
        if spec["role"] == "scalar":
            got = rows if isinstance(rows, list) else rows.tolist()
            assert got == spec["rows"], name
            continue
        assert len(rows) == len(spec["rows"]), name
        for g, w in zip(rows, spec["rows"], strict=True):
            if w is None:
                assert g is None, name
            elif spec["role"] == "media":
                assert isinstance(g, list) and len(g) == len(w), name
                for gs, ws in zip(g, w, strict=True):
                    _assert_row(gs, ws, dtype)
            else:
                _assert_row(g, w, dtype)


@pytest.mark.torch
@pytest.mark.parametrize("ref", ["rollout_vlm@1", "rollout_vlm_bf16@1"])
def test_golden_image_shared_by_two_generations_travels_once(ref: str) -> None:
    data, _ = _golden(ref)
    rb = read_ipc(data)
    px = rb.column("pixel_values").values
    assert px.indices.to_pylist() == [0, 0, 1]  # q0_g0's image, q0_g1's same image, a tile
    assert len(px.dictionary) == 2
    out = flightq.decode(rb)
    assert out["pixel_values"][0][0].data_ptr() == out["pixel_values"][1][0].data_ptr()


def test_golden_bf16_pixels_decode_to_numpy_as_bit_patterns(torch: ModuleType) -> None:
    data, want = _golden("rollout_vlm_bf16@1")
    out = flightq.decode(read_ipc(data), as_="numpy")
    seg = out["pixel_values"][0][0]
    recorded = want["fields"]["pixel_values"]["rows"][0][0]
    assert seg.dtype == np.uint16 and list(seg.shape) == recorded["shape"]
    bits = torch.tensor(recorded["values"], dtype=torch.bfloat16).view(torch.uint16)
    assert seg.reshape(-1).tolist() == bits.tolist()


# The bf16 inputs are torch tensors: numpy has no bfloat16.
ENCODED = [pytest.param(r, marks=pytest.mark.torch) if "bf16" in r else r for r in FINGERPRINTS]


@pytest.mark.parametrize("ref", ENCODED)
def test_encoding_the_golden_inputs_gives_the_golden_bytes(ref: str) -> None:
    data, _ = _golden(ref)
    assert make_golden.encode(ref) == data


@pytest.mark.torch
@pytest.mark.parametrize("ref", FINGERPRINTS)
def test_re_encoding_the_decoded_golden_rows_gives_the_golden_bytes(ref: str) -> None:
    data, _ = _golden(ref)
    out = flightq.decode(read_ipc(data))
    again = flightq.encode(out.schema, out.to_dict(), out.keys, make_golden.inputs(ref)[2])
    assert make_golden.stream_bytes(again) == data


@pytest.mark.torch  # the generator records values through torch
def test_generator_script_reproduces_every_golden_file_in_a_fresh_process(tmp_path: Path) -> None:
    script = GOLDEN_DIR / "make_golden.py"
    subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    for ref in FINGERPRINTS:
        for mine, theirs in zip(
            make_golden.paths(ref), make_golden.paths(ref, tmp_path), strict=True
        ):
            assert theirs.read_bytes() == mine.read_bytes(), f"{theirs.name} of {ref} differs"


@pytest.mark.torch
def test_generator_refuses_to_rewrite_a_golden_file_that_differs(tmp_path: Path) -> None:
    stream, _ = make_golden.paths("rollout_text@1", tmp_path)
    stream.parent.mkdir(parents=True)
    stream.write_bytes(b"an older wire format")
    assert make_golden.main(["--out", str(tmp_path)]) == 1
    assert stream.read_bytes() == b"an older wire format"
