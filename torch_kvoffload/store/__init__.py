"""Host KV pool backends behind one interface (:class:`KVStore`).

* ``local`` — :class:`LocalKVStore`, the embedded default (in-process, capacity-bounded, LRU).
* ``mooncake`` — :class:`MooncakeKVStore` (Mooncake Store; optional package, imported on use).
* ``memcache`` — :class:`MemcacheKVStore` (``memcache_hybrid``, Ascend; optional, imported on use).

Keys come from :func:`block_hashes` + :func:`layer_block_keys`, with :func:`cache_layout_fingerprint` as
the model id; :func:`create_store` /
:class:`StoreConfig` pick and build a backend.
"""

from torch_kvoffload.store.base import (
    KVStore,
    RecordLayout,
    StoreClosedError,
    StoreError,
    StoreLease,
    StoreUnavailableError,
)
from torch_kvoffload.store.factory import StoreConfig, build_store, create_store
from torch_kvoffload.store.keys import (
    block_hashes,
    cache_layout_fingerprint,
    layer_block_keys,
    layer_key_prefix,
    parse_layer_block_key,
)
from torch_kvoffload.store.local import LocalKVStore
from torch_kvoffload.store.memcache import MemcacheKVStore
from torch_kvoffload.store.mooncake import MooncakeKVStore
from torch_kvoffload.store.sizes import parse_bytes

__all__ = [
    "KVStore",
    "LocalKVStore",
    "MemcacheKVStore",
    "MooncakeKVStore",
    "RecordLayout",
    "StoreClosedError",
    "StoreConfig",
    "StoreError",
    "StoreLease",
    "StoreUnavailableError",
    "block_hashes",
    "build_store",
    "cache_layout_fingerprint",
    "create_store",
    "layer_block_keys",
    "layer_key_prefix",
    "parse_bytes",
    "parse_layer_block_key",
]
