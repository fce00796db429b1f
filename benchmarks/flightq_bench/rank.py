"""One trainer rank of ``flightq bench --ranks``: a process claiming whole groups.

The parent (:mod:`flightq_bench.ranks`) starts the ranks with multiprocessing's spawn
context and talks to each over a pipe:

- the rank answers ``("ready", placement)`` once it has its device, its NUMA placement
  and its client;
- ``("prep", partition, keys)``: a get of ``keys`` (no claim) warms the CUDA context, the
  pinned pool and the connection before the first timed drain; answered ``"ready"``;
- ``("go", partition)``: claim ``batch`` rows (whole groups) for task ``train`` into the
  rank's device, touch every field's rows, ack, until nothing is ready; answered with the
  keys claimed, the claims and the drain's start and end (``time.monotonic``, one clock
  for every process of the host);
- ``None``: close and exit.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

__all__ = ["rank_device", "rank_main"]


def rank_device(rank: int, device: str, count: int) -> str | None:
    """The device rank ``rank`` claims into: ``cuda:rank % count``, or None on the CPU."""
    if device == "cpu":
        return None
    if count < 1:
        raise ValueError(f"--device cuda: torch sees no CUDA device for rank {rank}")
    return f"cuda:{rank % count}"


def _place(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Pin this process on its GPU's NUMA node (see :mod:`flightq.cuda.numa`)."""
    from flightq.cuda.numa import bus_id, place_on_gpu_node

    if not cfg["numa"]:
        return {"applied": False, "reason": "--no-numa", "node": None}
    pci = cfg.get("pci") or []
    if pci:  # addresses given (a test's sysfs tree): rank i takes GPU i % len
        addr: str | None = pci[rank % len(pci)]
    elif cfg["device"] == "cuda":
        import torch

        addr = bus_id(rank % torch.cuda.device_count())
    else:
        return {"applied": False, "reason": "device cpu: no GPU to place", "node": None}
    p = place_on_gpu_node(addr, cfg["sysfs"])
    return {**dataclasses.asdict(p), "pci": addr}


def rank_main(rank: int, cfg: dict[str, Any], conn: Any) -> None:
    """The rank's loop (the target of its process); ``cfg`` as built by the parent."""
    placement = _place(rank, cfg)  # before anything allocates pinned memory
    import flightq
    from flightq.errors import ClaimTimeoutError

    dev = None
    as_ = "numpy"
    if cfg["device"] == "cuda":
        import torch

        dev = rank_device(rank, "cuda", torch.cuda.device_count())
        torch.cuda.set_device(torch.device(str(dev)))
        as_ = "torch"
    placement["device"] = dev or "cpu"
    with flightq.connect(cfg["location"], [cfg["schema"]], timeout=cfg["timeout"]) as c:
        conn.send(("ready", placement))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg[0] == "prep":
                _, partition, keys = msg
                b = c.get(partition, keys, device=dev, as_=as_)
                for f in b.fields:
                    b[f]
                del b
                conn.send("ready")
                continue
            _, partition = msg
            start = time.monotonic()
            end, claims, got = start, 0, []
            while True:
                try:
                    b = c.claim(partition, "train", cfg["batch"], device=dev, as_=as_, timeout=0.0)
                except ClaimTimeoutError:
                    break  # every row is claimed: the step is drained
                for f in b.fields:
                    b[f]  # every field's per-row tensors, as a trainer's collate reads them
                got += b.keys
                c.ack(b)
                del b
                claims += 1
                end = time.monotonic()
            pinned = None
            if dev is not None:
                from flightq.cuda import pinned_held

                pinned = pinned_held()
            conn.send({"keys": got, "claims": claims, "start": start, "end": end, "pinned": pinned})
