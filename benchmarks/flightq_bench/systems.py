"""The systems a run compares: what each needs installed, its server, its two halves.

A system is ``local`` (one process: memcpy), ``direct`` (producer sends straight to the
consumer: raw TCP, pickle 5) or ``server`` (producer puts into a server process, the
consumer gets from it). Servers are shared where systems share infrastructure: Ray and
TransferQueue run on one local Ray cluster.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

from . import flightq_system, peers, procs

__all__ = [
    "System",
    "SYSTEMS",
    "BASELINE",
    "PEERS",
    "COMPARED",
    "CUDA_SYSTEMS",
    "resolve",
    "missing_module",
    "server_for",
]


@dataclass(frozen=True)
class System:
    """One compared system.

    Attributes
    ----------
    name:
        As shown in the output.
    kind:
        ``local``, ``direct`` or ``server``.
    producer, consumer:
        ``module:Class`` of the two halves (``producer`` empty for ``local``).
    server:
        Key of the server group it needs (``flightq``, ``flight``, ``peers``), or ``""``.
    requires:
        Importable modules it needs; a missing one makes it ``skipped (not installed)``.
    server_procs:
        Substrings of the command lines of the server processes whose RSS is its server's
        (empty: the server group's main process).
    note:
        What exactly is measured.
    device:
        ``cpu``, or ``cuda`` for the systems that ``flightq bench --device cuda`` adds.
    """

    name: str
    kind: str
    producer: str
    consumer: str
    server: str = ""
    requires: tuple[str, ...] = ()
    server_procs: tuple[str, ...] = ()
    note: str = ""
    device: str = "cpu"
    #: Measured when no systems are named (the compressed ones only when asked for).
    default: bool = True


_M = "flightq_bench."

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in [
        System(
            "memcpy",
            "local",
            "",
            _M + "direct:MemcpyConsumer",
            note="copy into a preallocated, pre-touched buffer; one thread",
        ),
        System(
            "raw-tcp",
            "direct",
            _M + "direct:TcpProducer",
            _M + "direct:TcpConsumer",
            note="loopback TCP, sendall per tensor, recv_into a preallocated buffer",
        ),
        System(
            "pickle5",
            "direct",
            _M + "direct:PickleProducer",
            _M + "direct:PickleConsumer",
            note="pickle protocol 5, out-of-band buffers over a loopback socket",
        ),
        System(
            "bare-flight",
            "server",
            _M + "arrowflight:FlightProducer",
            _M + "arrowflight:FlightConsumer",
            server="flight",
            note="pyarrow Flight DoPut/DoGet, one large_binary column, 64 MiB batches",
        ),
        System(
            "bare-flight-once",
            "server",
            _M + "arrowflight:FlightOnceProducer",
            _M + "arrowflight:FlightOnceConsumer",
            server="flight",
            note="the same, each shared image once (the step's distinct bytes, as flightq "
            "moves them), 4 MiB batches: the Flight transport alone for media sent once",
        ),
        System(
            "bare-flight-records",
            "server",
            _M + "arrowflight:FlightRecordsProducer",
            _M + "arrowflight:FlightRecordsConsumer",
            server="flight",
            note="flightq's own record batches (as a put encodes them, untimed) over bare "
            "Flight, read back without checks or decoding: flightq's wire format, transport "
            "alone",
        ),
        System(
            "bare-flight-rows",
            "server",
            _M + "rowsflight:RowsProducer",
            _M + "rowsflight:RowsConsumer",
            server="flight",
            requires=("torch",),
            note="a tensor per row over bare Flight, no checks: the put gathers each field's "
            "rows, shapes and tags inside the timer, the get builds every row's tensor; "
            "a shared image travels with every row using it",
            default=False,
        ),
        System(
            "bare-flight-exchange",
            "server",
            _M + "arrowflight:FlightExchangeProducer",
            _M + "arrowflight:FlightExchangeConsumer",
            server="flight",
            note="the same record batches as messages on a DoExchange each side holds open "
            "(a put: one message and its answer; a get: one request and the stored "
            "messages), nothing parsed: a session design's floor on Flight",
        ),
        System(
            "transferqueue",
            "server",
            _M + "peers:TqProducer",
            _M + "peers:TqConsumer",
            server="peers",
            requires=("transfer_queue", "ray", "tensordict"),
            server_procs=("SimpleStorageUnit", "TransferQueueController"),
            note="kv_batch_put / kv_batch_get, SimpleStorage (2 units) on Ray",
        ),
        System(
            "ray",
            "server",
            _M + "peers:RayProducer",
            _M + "peers:RayConsumer",
            server="peers",
            requires=("ray",),
            server_procs=("raylet", "gcs_server", "RefBox"),
            note="ray.put / ray.get across processes (same-node shared memory) of "
            "per-row numpy arrays",
        ),
        System(
            "ray-torch",
            "server",
            _M + "peers:RayTorchProducer",
            _M + "peers:RayTorchConsumer",
            server="peers",
            requires=("ray", "torch"),
            server_procs=("raylet", "gcs_server", "RefBox"),
            note="the same with per-row torch tensors, what flightq puts and gets, "
            "with Ray's zero-copy torch serializer on (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS)",
            default=False,
        ),
        System(
            "flightq",
            "server",
            _M + "flightq_system:FlightqProducer",
            _M + "flightq_system:FlightqConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight"),
            note="Client.put / Client.get by key, torch views of every field",
        ),
        System(
            "flightq-zstd-tokens",
            "server",
            _M + "flightq_system:FlightqZstdTokensProducer",
            _M + "flightq_system:FlightqZstdTokensConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight"),
            note="the same with the schema's token fields zstd-compressed (level 3): "
            "encoded in the put, decoded in the get",
            default=False,
        ),
        System(
            "flightq-zstd",
            "server",
            _M + "flightq_system:FlightqZstdProducer",
            _M + "flightq_system:FlightqZstdConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight"),
            note="the same with token, tensor and media fields (pixel values) "
            "zstd-compressed (level 3)",
            default=False,
        ),
        System(
            "flightq-groups",
            "server",
            _M + "flightq_system:FlightqGroupsProducer",
            _M + "flightq_system:FlightqGroupsConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight"),
            note="the same, put a prompt group at a time as a generator writes (one put "
            "per group; W2 has no groups: one put), then one get of the step",
        ),
        System(
            "flightq-stream",
            "server",
            _M + "stream_system:FlightqStreamProducer",
            _M + "stream_system:FlightqClaimConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight"),
            note="W5: two writer processes put one row per put (groups split between "
            "them, rows interleaved), then one claim of the whole step for 'train'; also "
            "the bytes received, held and sent against the step's distinct bytes",
        ),
        System(
            "flightq-packed",
            "server",
            _M + "flightq_system:FlightqPackedProducer",
            _M + "flightq_system:FlightqPackedConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight", "torch"),
            note="the same with token and tensor columns put as flightq.Packed(flat, "
            "cu_seqlens) and read packed (views, no tensor per row), as a packed-sequence "
            "trainer holds them; media and scalars as flightq",
            default=False,
        ),
        System(
            "flightq-tensordict",
            "server",
            _M + "flightq_system:FlightqTensordictProducer",
            _M + "flightq_system:FlightqTensordictConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight", "tensordict"),
            note="the step put and read as a TensorDict (get(as_='tensordict'); "
            "flightq.compat.transferqueue returns the same without its __key__ and "
            "__tags__ entries): token fields jagged, media rows as a NonTensorStack",
            default=False,
        ),
        System(
            "flightq-shm",
            "server",
            _M + "flightq_system:FlightqShmProducer",
            _M + "flightq_system:FlightqShmConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight", "flightq.shm"),
            note="the same through /dev/shm (connect(shm=True)): Flight carries the "
            "segment reference, the bytes are mapped",
        ),
        System(
            "flightq-shm-numpy",
            "server",
            _M + "flightq_system:FlightqShmNumpyProducer",
            _M + "flightq_system:FlightqShmNumpyConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight", "flightq.shm"),
            note="flightq-shm putting the generated numpy arrays and reading numpy views "
            "(as_='numpy'): the types the ray peer carries",
            default=False,
        ),
        System(
            "flightq-shm-copy",
            "server",
            _M + "flightq_system:FlightqShmCopyProducer",
            _M + "flightq_system:FlightqShmCopyConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight", "flightq.shm"),
            note="flightq-shm with direct reads off (Client.shm_direct = False): the "
            "writer copies the payloads into its segment, the server copies the segment",
            default=False,
        ),
        System(
            "flightq-cuda",
            "server",
            _M + "flightq_system:FlightqCudaProducer",
            _M + "flightq_system:FlightqCudaConsumer",
            server="flightq",
            requires=("flightq.client.client", "flightq.server.flight", "torch"),
            note="Client.put from CUDA tensors / Client.get(device='cuda:0'), CUDA tensors "
            "of every field, copies completed",
            device="cuda",
        ),
        System(
            "h2d-pinned",
            "local",
            "",
            _M + "flightq_system:PinnedH2DConsumer",
            requires=("torch",),
            note="one torch copy of the step's bytes from a pinned host buffer to the GPU "
            "(non_blocking, then synchronize): the limit of any get into GPU memory",
            device="cuda",
        ),
    ]
}

#: What ``--device cuda`` measures besides the systems asked for: flightq on the CPU
#: (the baseline of the same run), flightq into and out of CUDA memory, and the H2D limit.
CUDA_SYSTEMS = ("flightq", "flightq-cuda", "h2d-pinned")

#: The wire reference every ratio is also taken against.
BASELINE = "raw-tcp"
#: Systems flightq is compared with pair by pair.
PEERS = (
    "pickle5",
    "bare-flight",
    "bare-flight-once",
    "bare-flight-records",
    "bare-flight-rows",
    "bare-flight-exchange",
    "transferqueue",
    "ray",
    "ray-torch",
)


#: The flightq systems each compared with every peer of the run.
COMPARED = ("flightq", "flightq-shm", "flightq-shm-numpy", "flightq-tensordict", "flightq-packed")


def missing_module(system: System) -> str | None:
    """The first required module that is not installed, or None."""
    for mod in system.requires:
        try:
            if importlib.util.find_spec(mod) is None:
                return mod
        except (ImportError, ValueError):
            return mod
    return None


def resolve(names: list[str] | None, device: str = "cpu") -> list[System]:
    """The systems named (all the CPU ones when None), in the canonical order.

    With ``device="cuda"`` the :data:`CUDA_SYSTEMS` are added to those.

    Raises
    ------
    ValueError
        For an unknown name, listing the known ones.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; expected cpu or cuda")
    if not names:
        names = [s.name for s in SYSTEMS.values() if s.device == "cpu" and s.default]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    if device == "cuda":
        names = [*names, *CUDA_SYSTEMS]
    return [s for s in SYSTEMS.values() if s.name in names]


def server_for(
    key: str, want_tq: bool, host: str = "127.0.0.1", netns: str | None = None
) -> procs.ServerProcess:
    """The (not yet started) server process of a server group; with ``netns``, started
    inside that network namespace (a testbed host) and bound to its address ``host``."""
    py = sys.executable
    wrap = ["ip", "netns", "exec", netns] if netns else []
    if key == "flightq":
        return procs.ServerProcess([*wrap, *flightq_system.server_argv(host)], "flightq")
    if key == "flight":
        argv = [*wrap, py, "-m", _M + "arrowflight", "--host", host]
        return procs.ServerProcess(argv, "bare Flight")
    if netns:
        raise ValueError(f"server {key!r} does not run on a testbed host")
    if key == "peers":
        argv = [py, "-m", _M + "peer_head"] + (["--tq"] if want_tq else [])
        return procs.ServerProcess(argv, "Ray/TransferQueue", ready_timeout=120, env=peers.RAY_ENV)
    raise KeyError(key)
