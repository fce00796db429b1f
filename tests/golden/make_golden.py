"""Write the golden Arrow IPC streams, one per released schema version, deterministically.

Each ``<name>/v<N>.arrows`` is one record batch of :func:`inputs` encoded with
``flightq.encode`` under the shipped schema; ``<name>/v<N>.json`` beside it records what
the stream holds (keys, tags, and per field each row's shape and values), written from
the inputs, not from a decode. ``tests/test_golden.py`` checks that current code decodes
every stream to those values and re-encodes the inputs to the same bytes.

A released golden file is never rewritten: a wire change is a new schema version with a
new golden file. This script therefore writes only missing files and fails if an
existing one differs from what current code produces::

    .venv/bin/python tests/golden/make_golden.py            # write what is missing
    .venv/bin/python tests/golden/make_golden.py --out DIR  # write all into DIR
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import flightq

HERE = Path(__file__).resolve().parent
GOLDEN = ("rollout_text@1", "rollout_vlm@1", "rollout_vlm_bf16@1")

Inputs = tuple[dict[str, Any], list[str], list[dict[str, Any] | None]]


def _f32(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def _i64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _text_inputs() -> Inputs:
    keys = ["p0_g0", "p0_g1", "p1_g0"]
    tags: list[dict[str, Any] | None] = [
        {"weight_version": 1, "prompt_idx": 0},
        {"weight_version": 1, "prompt_idx": 0},
        None,
    ]
    columns = {
        "input_ids": [_i64([101, 7592, 2088, 999, 102]), _i64([101, 42, 102]), _i64([])],
        "input_lengths": np.asarray([5, 3, 0], dtype=np.int32),
        "generation_logprobs": [
            _f32([-0.5, -1.25, -0.0, -3.5, -0.125]),
            _f32([-2.0, -0.25, -1.0]),
            _f32([]),
        ],
        "prev_logprobs": [_f32([-0.5, -1.0, -0.0, -3.0, -0.25]), None, _f32([])],
        "reference_policy_logprobs": [None, None, None],
        "advantages": [_f32([0.75] * 5), _f32([-0.75] * 3), _f32([])],
        "token_mask": [_i64([0, 0, 1, 1, 1]), _i64([0, 1, 1]), _i64([])],
        "sample_mask": [1.0, 0.5, None],
        "total_reward": _f32([1.0, 0.0, -1.5]),
        "truncated": np.asarray([False, True, False]),
        "mask_sample": [False, False, True],
    }
    return columns, keys, tags


def _vlm_inputs(bf16: bool) -> Inputs:
    def px(values: np.ndarray) -> Any:
        # every value is exact in bfloat16, so the bf16 stream holds the same numbers
        if not bf16:
            return values
        import torch  # only the bf16 stream needs it: the others build where torch is absent

        return torch.from_numpy(values).to(torch.bfloat16)

    keys = ["q0_g0", "q0_g1", "t0_g0"]
    tags: list[dict[str, Any] | None] = [
        {"weight_version": 2, "prompt_idx": 0},
        {"weight_version": 2, "prompt_idx": 0},
        {"weight_version": 2, "prompt_idx": 1},
    ]
    patches = _f32(np.arange(12).reshape(2, 6) * 0.5 - 2.0)  # Qwen-style [n, 1176], tiny
    tile = _f32(np.arange(12).reshape(1, 3, 2, 2) * -0.25)  # Omni-style [t, 3, H, W]
    video = _f32(np.arange(6).reshape(2, 3) + 0.5)
    shared = px(patches)  # q0_g0 and q0_g1 answer one prompt: one image, one dictionary entry
    grid = _i64([[1, 1, 2]])
    columns = {
        "input_ids": [_i64(np.arange(6) + 1000), _i64(np.arange(6) + 2000), _i64([5, 6, 7, 8])],
        "mm_token_type_ids": [_i64([0, 1, 1, 1, 0, 0]), _i64([0, 1, 1, 0, 0, 0]), _i64([0] * 4)],
        "token_type_ids": [None, None, _i64([0, 0, 0, 0])],
        "pixel_values": [[shared], [shared, px(tile)], []],
        "image_grid_thw": [[grid], [grid], []],
        "imgs_sizes": [None, [np.asarray([[2, 2]], dtype=np.int32)], []],
        "num_frames": [None, [np.asarray([1], dtype=np.int32)], []],
        "pixel_values_videos": [[px(video)], [], []],
        "video_grid_thw": [[_i64([[2, 1, 1]])], [], []],
        "total_reward": _f32([1.0, 0.0, 0.5]),
        "truncated": np.asarray([False, False, True]),
    }
    return columns, keys, tags


def inputs(ref: str) -> Inputs:
    """The columns, keys and tags of the golden stream of ``ref``."""
    if ref == "rollout_text@1":
        return _text_inputs()
    if ref == "rollout_vlm@1":
        return _vlm_inputs(bf16=False)
    if ref == "rollout_vlm_bf16@1":
        return _vlm_inputs(bf16=True)
    raise KeyError(f"no golden inputs for {ref!r}; add them to {__file__}")


def stream_bytes(rb: pa.RecordBatch) -> bytes:
    """One record batch as an Arrow IPC stream, with pyarrow's default write options."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.schema) as writer:
        writer.write_batch(rb)
    return sink.getvalue().to_pybytes()


def encode(ref: str) -> bytes:
    """The golden stream of ``ref`` as current code writes it."""
    schema = flightq.SchemaRegistry.default().get(ref)
    columns, keys, tags = inputs(ref)
    return stream_bytes(flightq.encode(schema, columns, keys, tags))


def _tensor_json(x: Any) -> dict[str, Any]:
    import torch

    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    flat = t.reshape(-1)
    values = flat.tolist() if t.dtype == torch.bool else flat.to(torch.float64).tolist()
    if not t.dtype.is_floating_point and t.dtype != torch.bool:
        values = [int(v) for v in values]
    return {"shape": list(t.shape), "values": values}


def expected(ref: str) -> dict[str, Any]:
    """What the golden stream of ``ref`` holds, written from its inputs."""
    schema = flightq.SchemaRegistry.default().get(ref)
    columns, keys, tags = inputs(ref)
    fields: dict[str, Any] = {}
    for f in schema:
        if f.name not in columns:
            continue
        col = columns[f.name]
        if f.role == "scalar":
            rows: list[Any] = [
                None if v is None else v.item() if hasattr(v, "item") else v for v in col
            ]
        elif f.role == "media":
            rows = [None if r is None else [_tensor_json(s) for s in r] for r in col]
        else:
            rows = [None if r is None else _tensor_json(r) for r in col]
        fields[f.name] = {"dtype": f.dtype, "role": f.role, "rows": rows}
    return {
        "schema": ref,
        "fingerprint": schema.fingerprint,
        "keys": keys,
        "tags": [t if t is not None else {} for t in tags],
        "fields": fields,
    }


def paths(ref: str, root: Path = HERE) -> tuple[Path, Path]:
    """``(stream, expected json)`` paths of ``ref`` under ``root``."""
    name, _, version = ref.partition("@")
    return root / name / f"v{version}.arrows", root / name / f"v{version}.json"


def _json_text(ref: str) -> str:
    text = json.dumps(expected(ref), indent=1, sort_keys=True)
    # one line per list of numbers, so a tensor reads as {"shape": [..], "values": [..]}
    flat = re.compile(
        r"\[\s*((?:-?[\d.eE+-]+|true|false|null)(?:,\s*(?:-?[\d.eE+-]+|true|false|null))*)\s*\]"
    )
    return (
        flat.sub(lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text)
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Write the missing golden files; fail on an existing one that current code disagrees with."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="folder to write (default: here)")
    args = p.parse_args(argv)
    status = 0
    for ref in GOLDEN:
        for path, data in zip(
            paths(ref, args.out), (encode(ref), _json_text(ref).encode()), strict=True
        ):
            if path.exists():
                if path.read_bytes() != data:
                    print(
                        f"{path}: differs from what current code writes; golden files are never "
                        "rewritten (a wire change needs a new schema version)",
                        file=sys.stderr,
                    )
                    status = 1
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"wrote {path}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
