"""Atheris harness: hostile IPC bytes must give flightq errors, never a crash.

Outside CI (atheris is not a test dependency). Run, e.g. for ten minutes::

    pip install atheris
    python fuzz/fuzz_decode.py -max_total_time=600 fuzz/corpus

Each input is parsed as an Arrow IPC stream (Arrow may refuse it: fine, the server turns
that into a ProtocolError), then every batch goes through :func:`flightq.layout.validate`
and :func:`flightq.decode` with every field and the tags read. Any exception other than a
``FlightqError`` (or a crash) is a finding.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import numpy as np
    import pyarrow as pa

    import flightq
    from flightq.layout import validate

__all__ = ["seeds", "test_one_input"]


def seeds() -> list[bytes]:
    """Valid streams to start from: text rows with tags, VLM rows with media."""
    reg = flightq.SchemaRegistry.default()
    text = flightq.encode(
        reg.get("rollout_text@1"),
        {"input_ids": [np.arange(3), np.arange(0)], "total_reward": np.ones(2, np.float32)},
        ["a", "b"],
        [{"step": 1}, None],
    )
    vlm = flightq.encode(
        reg.get("rollout_vlm@1"),
        {
            "input_ids": [np.arange(4)],
            "pixel_values": [[np.ones((2, 3), np.float32), np.zeros((1, 3), np.float32)]],
        },
        ["v0"],
    )
    out = []
    for rb in (text, vlm):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rb.schema) as w:
            w.write_batch(rb)
        out.append(sink.getvalue().to_pybytes())
    return out


def test_one_input(data: bytes) -> None:
    """One fuzz input."""
    try:
        batches = list(pa.ipc.open_stream(pa.py_buffer(data)))
    except (pa.ArrowException, OSError, ValueError):
        return
    for batch in batches:
        try:
            validate(batch)
            b = flightq.decode(batch, as_="numpy")
            _ = [b[name] for name in b.fields], b.tags
        except flightq.FlightqError:
            pass


def main() -> None:
    """Write the seed corpus next to this file if missing, then fuzz."""
    corpus = Path(__file__).with_name("corpus")
    if not corpus.exists():
        corpus.mkdir()
        for i, s in enumerate(seeds()):
            (corpus / f"seed{i}").write_bytes(s)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
