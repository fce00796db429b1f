"""Drop-in interfaces of other data systems over flightq.

:mod:`flightq.compat.transferqueue` offers TransferQueue 0.1.11's key/value interface
(``kv_batch_put``, ``kv_batch_get`` and the rest), so a verl or NeMo RL process switches
with one import: ``import flightq.compat.transferqueue as tq``.
"""

__all__: list[str] = []
