"""``transfer_queue`` as flightq's TransferQueue compat (:mod:`flightq.compat.transferqueue`).

Found first where :data:`flightq.compat.transferqueue.SHIM_PATH` leads ``PYTHONPATH``, so
that code importing TransferQueue by its name runs on flightq unchanged.
"""

from flightq.compat.transferqueue import *  # noqa: F403
from flightq.compat.transferqueue import __all__  # noqa: F401
