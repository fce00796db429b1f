"""The side-by-side benchmark behind ``flightq bench``.

One module per job: :mod:`~flightq.bench.payload` (the generated rows and the bit-exact
checks), :mod:`~flightq.bench.endpoint` (the producer and consumer halves of a system),
:mod:`~flightq.bench.direct`, :mod:`~flightq.bench.arrowflight`,
:mod:`~flightq.bench.peers` and :mod:`~flightq.bench.flightq_system` (the systems),
:mod:`~flightq.bench.systems` (their registry), :mod:`~flightq.bench.procs` (processes,
RSS, loopback checks), :mod:`~flightq.bench.worker` (the producer and consumer
processes), :mod:`~flightq.bench.runner` (the interleaved repetitions),
:mod:`~flightq.bench.stats` and :mod:`~flightq.bench.summarize` (figures and ratios),
:mod:`~flightq.bench.report` (JSON, markdown, PNG) and :mod:`~flightq.bench.cli`.
Nothing heavy is imported here.
"""

from __future__ import annotations

__all__: list[str] = []
