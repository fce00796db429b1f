"""The peers' server process: a local Ray cluster on 127.0.0.1, and TransferQueue on it.

``python -m flightq_bench.peer_head [--tq] [--num-cpus N] [--object-store BYTES]`` starts
Ray (GCS, raylet with its object store, a reference-passing actor) with an explicit CPU
count and a private temp folder, then, with ``--tq``, TransferQueue's controller and
storage units. It prints ``{"ray_address": ..., "tq": bool}`` and runs until SIGTERM or
until its standard input closes, then shuts everything down.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from .peers import NAMESPACE, RAY_ENV, REFBOX, RefBox

__all__ = ["main", "RAY_NUM_CPUS"]

#: Logical CPUs Ray may schedule: TransferQueue's controller and its two default
#: storage units each ask for one.
RAY_NUM_CPUS = 3


def _until_eof(stop: threading.Event) -> None:
    sys.stdin.read()
    stop.set()


def main(argv: list[str] | None = None) -> int:
    """Start the peers, report, wait, shut down."""
    p = argparse.ArgumentParser(prog="python -m flightq_bench.peer_head")
    p.add_argument("--tq", action="store_true", help="also start TransferQueue")
    p.add_argument("--num-cpus", type=int, default=RAY_NUM_CPUS)
    p.add_argument("--object-store", type=int, default=4 * 2**30)
    args = p.parse_args(argv)
    os.environ.update(RAY_ENV)
    import ray

    tmp = tempfile.mkdtemp(prefix="fqb-ray-")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        ray.init(
            num_cpus=args.num_cpus,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            object_store_memory=args.object_store,
            _temp_dir=tmp,
            namespace=NAMESPACE,
            log_to_driver=False,
            configure_logging=False,
        )
        # Ray's driver installs its own SIGTERM handler, which ends the process at once:
        # ours again, so that a SIGTERM still shuts Ray down and removes the folder.
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        box_cls: Any = ray.remote(num_cpus=0)(RefBox)
        box = box_cls.options(name=REFBOX, namespace=NAMESPACE, lifetime="detached").remote()
        ray.get(box.__ray_ready__.remote())
        if args.tq:
            import transfer_queue

            transfer_queue.init()
        info = {
            "ray_address": ray.get_runtime_context().gcs_address,
            "tq": bool(args.tq),
            "ray_version": ray.__version__,
        }
        if args.tq:
            info["tq_version"] = getattr(transfer_queue, "__version__", "?")
        print(json.dumps(info), flush=True)
        threading.Thread(target=_until_eof, args=(stop,), daemon=True).start()
        stop.wait()
        if args.tq:
            transfer_queue.close()
    finally:
        ray.shutdown()
        _remove(tmp)
    return 0


def _remove(tmp: str, wait: float = 5.0) -> None:
    """Remove Ray's temp folder, again while Ray's last processes, still exiting after
    ``ray.shutdown()``, write their logs into it anew (it was left behind otherwise)."""
    deadline = time.monotonic() + wait
    while True:
        shutil.rmtree(tmp, ignore_errors=True)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.25)
        if not os.path.exists(tmp):
            time.sleep(0.25)  # a late writer makes it again within this
            if not os.path.exists(tmp):
                return


if __name__ == "__main__":
    raise SystemExit(main())
