"""The side-by-side benchmark behind ``flightq bench``.

One module per job: :mod:`~flightq_bench.payload` (the generated rows and the bit-exact
checks), :mod:`~flightq_bench.endpoint` (the producer and consumer halves of a system),
:mod:`~flightq_bench.direct`, :mod:`~flightq_bench.arrowflight`,
:mod:`~flightq_bench.peers` and :mod:`~flightq_bench.flightq_system` (the systems),
:mod:`~flightq_bench.systems` (their registry), :mod:`~flightq_bench.procs` (processes,
RSS, loopback checks), :mod:`~flightq_bench.worker` (the producer and consumer
processes), :mod:`~flightq_bench.runner` (the interleaved repetitions),
:mod:`~flightq_bench.stats` and :mod:`~flightq_bench.summarize` (figures and ratios),
:mod:`~flightq_bench.report` (JSON, markdown, PNG) and :mod:`~flightq_bench.cli`.
Nothing heavy is imported here.

The harness lives beside the package, not in the wheel: ``flightq bench`` finds it in a
source checkout. It starts its servers and workers as ``python -m flightq_bench.<module>``,
so importing it puts its folder on ``PYTHONPATH`` for those child processes.
"""

from __future__ import annotations

import os

__all__: list[str] = []

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _HERE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_HERE, os.environ.get("PYTHONPATH", "")) if p
    )
