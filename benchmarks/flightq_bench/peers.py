"""Peers: the Ray object store across processes, and TransferQueue's KV API.

Both run on one local Ray cluster started by :mod:`flightq_bench.peer_head` in its own
process, bound to 127.0.0.1. Producer and consumer join it as drivers.

- ``ray``: the producer ``ray.put``s the step (keys, tags, per-row numpy arrays) and hands
  the reference to a named actor; the consumer takes the reference and ``ray.get``s it.
  Same-node Ray reads from shared memory, so its get is a mapping, not a transfer; the
  pages show up in the producer's and consumer's RSS (``RssShmem``), not the raylet's.
  Like pickle, Ray serialises an array referenced by several rows once.
- ``ray-torch``: the same with the rows as torch tensors (what flightq puts and hands
  out), with Ray's zero-copy torch serializer on (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``,
  in :data:`RAY_ENV`; without it Ray pickles every tensor's bytes in band).
- ``transferqueue``: ``kv_batch_put`` of a TensorDict (token fields as jagged nested
  tensors, media as a NonTensorStack of per-row segment lists, scalars as tensors),
  ``kv_batch_get`` by key, ``kv_clear``; TransferQueue's own controller and its default
  two SimpleStorage units, as Ray actors.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from .endpoint import Consumer, Producer, now_ns, timed
from .payload import as_payload, check_rows

__all__ = [
    "RAY_ENV",
    "NAMESPACE",
    "REFBOX",
    "RefBox",
    "ray_connect",
    "RayProducer",
    "RayTorchProducer",
    "RayConsumer",
    "RayTorchConsumer",
    "TqProducer",
    "TqConsumer",
]

#: Environment every process touching Ray gets: loopback, no usage reporting.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_AUTH_MODE": "token",
    "TQ_LOGGING_LEVEL": "ERROR",
    # Torch tensors mapped from the object store as numpy arrays are (Ray's default
    # pickles their bytes); read when ray is imported, so set before.
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}
NAMESPACE = "flightq_bench"
REFBOX = "flightq_bench_refbox"


class RefBox:
    """A Ray actor that hands object references from the producer to the consumer."""

    def __init__(self) -> None:
        self._refs: dict[str, Any] = {}

    def put(self, key: str, refs: list[Any]) -> None:
        """Hold ``refs`` (a list, so Ray passes the references, not the objects)."""
        self._refs[key] = refs

    def take(self, key: str) -> list[Any]:
        """Give the references and forget them."""
        return self._refs.pop(key)


def ray_connect(address: str) -> Any:
    """Join the benchmark's Ray cluster as a driver, on loopback."""
    os.environ.update(RAY_ENV)
    import ray

    if not ray.is_initialized():
        ray.init(
            address=address,
            _node_ip_address="127.0.0.1",
            namespace=NAMESPACE,
            log_to_driver=False,
            configure_logging=False,
        )
    return ray


class RayProducer(Producer):
    """``ray.put`` of the step, then its reference handed to the consumer through an actor."""

    #: Ends the reference's name in the actor: systems sharing it never share steps.
    suffix = ""

    def setup(self) -> dict[str, Any]:
        self.ray = ray_connect(self.info["ray_address"])
        self.box = self.ray.get_actor(REFBOX, namespace=NAMESPACE)
        self.key = f"{self.info['run']}-{self.step.name}{self.suffix}"
        self._ref: Any = None
        return {}

    def prepare(self) -> None:
        if getattr(self, "_payload", None) is None:
            self._payload = as_payload(self.step)

    def put(self) -> dict[str, Any]:
        ray = self.ray
        t0 = now_ns()
        self._ref = ray.put(self._payload)
        ray.get(self.box.put.remote(self.key, [self._ref]))
        return timed(t0)

    def clear(self) -> None:
        self._ref = None

    def close(self) -> None:
        self._ref = None


class RayTorchProducer(RayProducer):
    """``ray.put`` of the step's rows as torch tensors (views of the generated arrays,
    made once, untimed)."""

    suffix = "-torch"

    def prepare(self) -> None:
        if getattr(self, "_payload", None) is None:
            from flightq.workloads import to_torch

            self._payload = as_payload(to_torch(self.step))


class RayConsumer(Consumer):
    """Take the reference from the actor, ``ray.get`` the step."""

    suffix = ""

    def setup(self) -> dict[str, Any]:
        self.ray = ray_connect(self.info["ray_address"])
        self.box = self.ray.get_actor(REFBOX, namespace=NAMESPACE)
        self.key = f"{self.info['run']}-{self.ref.name}{self.suffix}"
        self._got: Any = None
        return {}

    def get(self) -> dict[str, Any]:
        ray = self.ray
        t0 = now_ns()
        (ref,) = ray.get(self.box.take.remote(self.key))
        self._got = ray.get(ref)
        return timed(t0)

    def verify(self) -> None:
        g = self._got
        check_rows(self.ref, g["keys"], g["columns"], g["tags"], "ray")

    def release(self) -> None:
        self._got = None


class RayTorchConsumer(RayConsumer):
    """``ray.get`` of what :class:`RayTorchProducer` put: the rows as torch tensors."""

    suffix = "-torch"


def _tq() -> Any:
    import transfer_queue

    return transfer_queue


def _to_tensordict(step: Any) -> Any:
    import numpy as np
    import torch
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    def t(a: Any) -> Any:
        x = torch.from_numpy(a)
        return x.view(torch.bfloat16) if a.dtype == np.uint16 else x

    fields: dict[str, Any] = {}
    for name, col in step.columns.items():
        if isinstance(col, np.ndarray):
            fields[name] = t(col)
        elif col and isinstance(col[0], list):
            fields[name] = NonTensorStack(*[NonTensorData([t(s) for s in row]) for row in col])
        else:
            fields[name] = torch.nested.as_nested_tensor([t(r) for r in col], layout=torch.jagged)
    return TensorDict(fields, batch_size=step.rows)


def _from_tensordict(td: Any) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for name in list(td.keys()):
        v = td.get(name)
        if isinstance(v, torch.Tensor) and v.is_nested:
            out[name] = list(v.unbind())
        elif isinstance(v, torch.Tensor):
            out[name] = v
        else:
            out[name] = v.tolist()
    return out


class TqProducer(Producer):
    """``kv_batch_put`` of the step as one TensorDict (built inside the timed region)."""

    def setup(self) -> dict[str, Any]:
        ray_connect(self.info["ray_address"])
        self.tq = _tq()
        with _quiet():
            self.tq.init()
        self.partition = f"bench-{self.info['run']}-{self.step.name}"
        return {}

    def put(self) -> dict[str, Any]:
        s = self.step
        t0 = now_ns()
        td = _to_tensordict(s)
        self.tq.kv_batch_put(keys=s.keys, partition_id=self.partition, fields=td, tags=s.tags)
        return timed(t0)

    def clear(self) -> None:
        self.tq.kv_clear(keys=self.step.keys, partition_id=self.partition)


class TqConsumer(Consumer):
    """``kv_batch_get`` by key, then every field's per-row tensors."""

    def setup(self) -> dict[str, Any]:
        ray_connect(self.info["ray_address"])
        self.tq = _tq()
        with _quiet():
            self.tq.init()
        self.partition = f"bench-{self.info['run']}-{self.ref.name}"
        self._got: Any = None
        return {}

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        td = self.tq.kv_batch_get(keys=self.ref.keys, partition_id=self.partition)
        self._got = _from_tensordict(td)
        return timed(t0)

    def verify(self) -> None:
        check_rows(self.ref, self.ref.keys, self._got, None, "transferqueue")

    def release(self) -> None:
        self._got = None


@contextlib.contextmanager
def _quiet() -> Any:
    import logging

    logging.getLogger("transfer_queue").setLevel(logging.ERROR)
    yield
