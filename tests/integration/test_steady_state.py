"""A long run in small: RL steps through a real ``flightq serve`` process, its resources
sampled as they go (``benchmarks/soak.py`` runs the same loop for thousands of steps and
reports memory drift).

Each step a generator puts two prompt groups with an image each, a logprob worker claims
them, writes a column back and acks, a trainer claims whole groups, checks every row and
clears them; every 10 steps a worker claims the rows and goes away without an ack, and
the rows come back. Counts are compared, never times or memory: what must not grow with
steps is what a leak per call, per claim or per lost worker would grow.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed")

import soak  # benchmarks/soak.py, on the suite's pythonpath

pytestmark = pytest.mark.torch

STEPS = 120
EVERY = 20


@pytest.mark.parametrize(
    ("shm", "per_step"),
    [(False, False), (True, False), (False, True)],
    ids=["socket", "shm", "socket-partition-per-step"],
)
def test_steps_with_lost_workers_leave_threads_files_and_segments_where_they_were(shm, per_step):
    # per_step: each step in a partition of its own, declared and dropped by the trainer.
    with soak.server_process(str(64 * 2**20)) as srv:
        assert srv.proc is not None
        samples = list(
            soak.run(
                srv.info["listening"],
                STEPS,
                server_pid=srv.proc.pid,
                crash_every=10,
                sample_every=EVERY,
                shm=shm,
                metrics=srv.info["metrics"],
                partition_per_step=per_step,
            )
        )
    assert [s.step for s in samples] == list(range(0, STEPS + 1, EVERY))
    warm, *later = samples[2:]  # after 40 steps: pools, caches and connections are made
    for s in later:
        # Open files: the three clients' connections and what the process holds; a lost
        # worker's connection closes with it.
        assert s.server_fds <= warm.server_fds, (s, warm)
        assert s.client_fds <= warm.client_fds, (s, warm)
        # Threads: gRPC's pool grows with calls at once (never past a few here), not with
        # steps; one per lost worker would add 8 by the end.
        assert s.server_threads <= warm.server_threads + 2, (s, warm)
        assert s.client_threads <= warm.client_threads + 2, (s, warm)
        # Segments: pools reuse theirs once their rows are cleared and no reader maps them.
        assert s.shm_files <= max(warm.shm_files, 1 if shm else 0), (s, warm)
        # Once each step is cleared the server holds no rows; its records of the past
        # (journals, ended leases, put ids) are kept within their own bounds and the
        # budget's, never more than the budget.
        assert s.server_held == 0, s
        if per_step:  # a dropped partition's records go with it
            assert s.server_records <= warm.server_records, (s, warm)
        else:
            assert 0 < s.server_records <= 64 * 2**20, s
    if not shm:
        assert all(s.shm_files == 0 for s in samples)
