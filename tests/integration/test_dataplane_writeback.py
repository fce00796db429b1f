"""The W1 write-back pattern with three real processes against one real server.

A generator puts whole groups, a logprob worker claims ``prev_lp`` with ``input_ids`` and
writes ``prev_logprobs`` under the same keys, a trainer claims ``train`` once
``prev_logprobs`` is there, reads every field, checks every byte against the regenerated
seeded step, and clears what it consumed.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from fixtures_dataplane import TIMEOUT, VLM, W1_TASKS, client_fixture, run_role, server_fixture  # noqa: F401

import flightq
from flightq import workloads

pytestmark = [pytest.mark.timeout(120), pytest.mark.torch]  # the trainer process reads torch


def _finish(procs: dict[str, subprocess.Popen[str]]) -> dict[str, dict]:
    out = {}
    try:
        for role, p in procs.items():
            stdout, stderr = p.communicate(timeout=3 * TIMEOUT)
            assert p.returncode == 0, f"{role} exited with {p.returncode}:\n{stderr}"
            out[role] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_w1_write_back_three_processes_deliver_every_byte_once_then_clear(server, client):
    ref = workloads.w1(groups=2)
    client.create_partition("w1", VLM, tasks=W1_TASKS, group_size=ref.group_size)
    # Consumers first: they block in claim until the generator's groups land.
    procs = {role: run_role(role, server.location, "w1") for role in ("trainer", "logprob")}
    procs["generator"] = run_role("generator", server.location, "w1")

    out = _finish(procs)

    assert out["generator"]["rows"] == ref.rows
    assert sorted(out["logprob"]["keys"]) == sorted(ref.keys)  # each row once to prev_lp
    assert sorted(out["trainer"]["keys"]) == sorted(ref.keys)  # each row once to train
    assert out["trainer"]["bytes"] > 100 * 2**20  # pixels included, not only text
    stats = client.stats()["partitions"]["w1"]
    assert stats["rows"] == 0
    assert stats["bytes"] == 0
    assert client.inspect("w1")["fields"] == {}


def test_trainer_claim_waits_for_write_back_not_for_rollout(server, client):
    ref = workloads.w1(groups=1)
    client.create_partition("w1", VLM, tasks=W1_TASKS, group_size=ref.group_size)
    client.put("w1", ref.keys, ref.columns, ref.tags)

    with pytest.raises(
        flightq.ClaimTimeoutError, match=r"0 rows ready with fields \['prev_logprobs'\]"
    ):
        client.claim("w1", "train", ref.group_size, ["prev_logprobs"], timeout=0.2)

    lp = workloads.logprobs_for(ref)
    b = client.claim("w1", "prev_lp", ref.group_size, ["input_ids"], timeout=TIMEOUT)
    client.put("w1", b.keys, {"prev_logprobs": [lp[ref.keys.index(k)] for k in b.keys]})
    got = client.claim("w1", "train", ref.group_size, ["prev_logprobs"], timeout=TIMEOUT)
    assert got.keys == ref.keys
