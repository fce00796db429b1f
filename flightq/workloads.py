"""The reference workloads (W1, W1-bf16, W2, W3, W4, W5), generated from a fixed seed.

Every benchmark, the demo and the tests measure on these steps, so figures compare the
same work. Sizes follow multimodal RL recipes: see docs/workloads.md. Arrays are numpy
(bfloat16 pixels as their uint16 bit patterns, converted to torch with :func:`to_torch`),
so generating a step needs no torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Step",
    "WORKLOADS",
    "make",
    "w1",
    "w1_bf16",
    "w2",
    "w3",
    "w4",
    "w5",
    "w5_copies",
    "to_torch",
]


@dataclass
class Step:
    """One generated step: what a generator would put."""

    name: str
    schema: str
    keys: list[str]
    columns: dict[str, Any]
    tags: list[dict[str, Any]]
    group_size: int
    #: A streamed step (W5): per writer process, the row indices it puts, one row per put,
    #: in that order. Empty: the step is put whole.
    streams: list[list[int]] = field(default_factory=list)
    #: Payload bytes with each distinct media content once, where equal content is not the
    #: same object (W5-copies); None: worked out from the objects.
    distinct: int | None = None

    @property
    def rows(self) -> int:
        """Number of rows."""
        return len(self.keys)

    def nbytes(self, distinct_media: bool = False) -> int:
        """Payload bytes of the step (each shared media segment once if ``distinct_media``)."""
        if distinct_media and self.distinct is not None:
            return self.distinct
        total = 0
        seen: set[int] = set()
        for col in self.columns.values():
            if isinstance(col, np.ndarray):
                total += col.nbytes
                continue
            for row in col:
                if row is None:
                    continue
                if isinstance(row, list):
                    for seg in row:
                        if distinct_media and id(seg) in seen:
                            continue
                        seen.add(id(seg))
                        total += seg.nbytes
                else:
                    total += row.nbytes
        return total

    def group(self, g: int) -> Step:
        """The rows of group ``g`` only."""
        lo, hi = g * self.group_size, (g + 1) * self.group_size
        cols = {k: v[lo:hi] for k, v in self.columns.items()}
        return Step(
            self.name, self.schema, self.keys[lo:hi], cols, self.tags[lo:hi], self.group_size
        )


def _token_rows(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    return [int(s) for s in rng.integers(lo, hi + 1, size=n)]


def _text_columns(
    rng: np.random.Generator, lens: list[int], vocab: int = 151_000
) -> dict[str, Any]:
    return {
        "input_ids": [rng.integers(0, vocab, size=s, dtype=np.int64) for s in lens],
        "generation_logprobs": [-rng.random(s, dtype=np.float32) * 5 for s in lens],
        "token_mask": [(rng.random(s) > 0.3).astype(np.int64) for s in lens],
        "input_lengths": np.asarray(lens, dtype=np.int32),
        "total_reward": rng.random(len(lens), dtype=np.float32),
        "truncated": rng.random(len(lens)) > 0.9,
    }


def _keys_tags(
    groups: int, g: int, weight_version: int = 0
) -> tuple[list[str], list[dict[str, Any]]]:
    keys = [f"p{p}_g{i}" for p in range(groups) for i in range(g)]
    tags = [
        {"weight_version": weight_version, "prompt_idx": p} for p in range(groups) for _ in range(g)
    ]
    return keys, tags


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns, round-to-nearest-even."""
    u = x.view(np.uint32)
    rounded = u + (((u >> 16) & 1) + 0x7FFF)
    return (rounded >> 16).astype(np.uint16)


def w1(seed: int = 0, bf16: bool = False, groups: int = 8, g: int = 16) -> Step:
    """W1 ``vlm-qwen``: 8 groups x 16, one [748, 1176] image per row, shared per group."""
    rng = np.random.default_rng(seed)
    n = groups * g
    lens = _token_rows(rng, n, 600, 2048)
    cols = _text_columns(rng, lens)
    cols["mm_token_type_ids"] = [(rng.random(s) > 0.8).astype(np.int64) for s in lens]
    pixels, grids = [], []
    for _ in range(groups):
        img = rng.standard_normal((748, 1176), dtype=np.float32)
        if bf16:
            img = _to_bf16_bits(img)
        grid = np.array([[1, 22, 34]], dtype=np.int64)
        pixels += [[img]] * g  # the same image object for the G generations of one prompt
        grids += [[grid]] * g
    cols["pixel_values"] = pixels
    cols["image_grid_thw"] = grids
    keys, tags = _keys_tags(groups, g)
    name = "W1-bf16" if bf16 else "W1"
    return Step(name, "rollout_vlm_bf16@1" if bf16 else "rollout_vlm@1", keys, cols, tags, g)


def w1_bf16(seed: int = 0) -> Step:
    """W1 with bfloat16 pixels."""
    return w1(seed, bf16=True)


def w2(seed: int = 0, groups: int = 12, g: int = 8) -> Step:
    """W2 ``vlm-omni``: 12 groups x 8, 1-3 images of [t, 3, H, W] per row, 1 row in 8 text-only."""
    rng = np.random.default_rng(seed)
    n = groups * g
    lens = _token_rows(rng, n, 600, 4096)
    cols = _text_columns(rng, lens)
    cols["mm_token_type_ids"] = [(rng.random(s) > 0.8).astype(np.int64) for s in lens]
    cols["token_type_ids"] = [(rng.random(s) > 0.8).astype(np.int64) for s in lens]
    pixels: list[list[np.ndarray]] = []
    sizes: list[list[np.ndarray]] = []
    frames: list[list[np.ndarray]] = []
    for i in range(n):
        if i % 8 == 7:  # text-only row: no segments at all
            pixels.append([])
            sizes.append([])
            frames.append([])
            continue
        px, sz, fr = [], [], []
        for _ in range(int(rng.integers(1, 4))):
            t = int(rng.integers(1, 5))
            h, w = (int(v) for v in rng.choice([448, 512], size=2))
            px.append(rng.standard_normal((t, 3, h, w), dtype=np.float32))
            sz.append(np.tile(np.array([[h, w]], dtype=np.int32), (t, 1)))
            fr.append(np.ones(t, dtype=np.int32))
        pixels.append(px)
        sizes.append(sz)
        frames.append(fr)
    cols["pixel_values"] = pixels
    cols["imgs_sizes"] = sizes
    cols["num_frames"] = frames
    keys, tags = _keys_tags(groups, g)
    return Step("W2", "rollout_vlm@1", keys, cols, tags, g)


def w3(seed: int = 0, groups: int = 32, g: int = 16) -> Step:
    """W3 ``text``: 32 groups x 16 rows, S in [256, 1536], no media."""
    rng = np.random.default_rng(seed)
    lens = _token_rows(rng, groups * g, 256, 1536)
    cols = _text_columns(rng, lens)
    keys, tags = _keys_tags(groups, g)
    return Step("W3", "rollout_text@1", keys, cols, tags, g)


def w4(seed: int = 0) -> Step:
    """W4 ``ping``: one W3-like row with S = 128."""
    rng = np.random.default_rng(seed)
    cols = _text_columns(rng, [128])
    return Step(
        "W4", "rollout_text@1", ["ping_g0"], cols, [{"weight_version": 0, "prompt_idx": 0}], 1
    )


def w5(seed: int = 0, copies: bool = False, writers: int = 2) -> Step:
    """W5 ``vlm-stream``: W1's rows put one row per put as generations finish.

    The rows of the 8 groups interleave in a seeded order; the groups are split between
    ``writers`` writer processes (:attr:`Step.streams`). With ``copies``, each row's image
    is its own array with its group's content (a processor run once per row). Images are
    read-only, so a client hashes each array once (:class:`flightq.digest.DigestCache`).
    """
    step = w1(seed)
    distinct = step.nbytes(distinct_media=True)
    pixels = step.columns["pixel_values"]
    for row in pixels:
        row[0].flags.writeable = False
    if copies:
        fresh = []
        for row in pixels:
            img = row[0].copy()
            img.flags.writeable = False
            fresh.append([img])
        step.columns["pixel_values"] = fresh
    rng = np.random.default_rng(seed + 5)
    order = [int(i) for i in rng.permutation(step.rows)]  # generations finish in any order
    g = step.group_size
    streams = [[i for i in order if (i // g) % writers == w] for w in range(writers)]
    name = "W5-copies" if copies else "W5"
    return Step(name, step.schema, step.keys, step.columns, step.tags, g, streams, distinct)


def w5_copies(seed: int = 0) -> Step:
    """W5 with each row's image its own array of equal content."""
    return w5(seed, copies=True)


def logprobs_for(step: Step, seed: int = 1) -> list[np.ndarray]:
    """The ``prev_logprobs`` a logprob worker writes back: one float32 per token."""
    rng = np.random.default_rng(seed)
    return [-rng.random(len(ids), dtype=np.float32) for ids in step.columns["input_ids"]]


WORKLOADS: dict[str, Callable[..., Step]] = {
    "W1": w1,
    "W1-bf16": w1_bf16,
    "W2": w2,
    "W3": w3,
    "W4": w4,
    "W5": w5,
    "W5-copies": w5_copies,
}


def make(name: str, seed: int = 0) -> Step:
    """Generate a workload by name (``W1``, ``W1-bf16``, ``W2``, ``W3``, ``W4``, ``W5``,
    ``W5-copies``)."""
    try:
        return WORKLOADS[name](seed)
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}"
        ) from None


def to_torch(step: Step) -> Step:
    """The same step with torch tensors (bfloat16 pixels as torch.bfloat16), sharing memory."""
    import torch

    def conv(x: np.ndarray) -> Any:
        with warnings.catch_warnings():  # W5's read-only images: the step never writes them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(x)
        return t.view(torch.bfloat16) if x.dtype == np.uint16 else t

    cols: dict[str, Any] = {}
    memo: dict[int, Any] = {}
    for k, v in step.columns.items():
        if isinstance(v, np.ndarray):
            cols[k] = conv(v)
            continue
        rows = []
        for row in v:
            if isinstance(row, list):
                rows.append(
                    [memo[id(s)] if id(s) in memo else memo.setdefault(id(s), conv(s)) for s in row]
                )
            else:
                rows.append(conv(row))
        cols[k] = rows
    return Step(
        step.name,
        step.schema,
        step.keys,
        cols,
        step.tags,
        step.group_size,
        step.streams,
        step.distinct,
    )
