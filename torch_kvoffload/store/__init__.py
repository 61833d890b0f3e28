"""Host KV pool backends behind one interface (:class:`KVStore`).

* ``local`` — :class:`LocalKVStore`, the embedded default (in-process, capacity-bounded, LRU).
* ``mooncake`` — :class:`~torch_kvoffload.store.mooncake.MooncakeKVStore` (Mooncake Store, optional).
* ``memcache`` — :class:`~torch_kvoffload.store.memcache.MemcacheKVStore` (``memcache_hybrid``, Ascend).

Keys come from :func:`block_hashes` + :func:`layer_block_keys`.
"""

from torch_kvoffload.store.base import KVStore, StoreClosedError
from torch_kvoffload.store.keys import block_hashes, layer_block_keys, parse_layer_block_key
from torch_kvoffload.store.local import LocalKVStore

__all__ = [
    "KVStore",
    "LocalKVStore",
    "StoreClosedError",
    "block_hashes",
    "layer_block_keys",
    "parse_layer_block_key",
]
