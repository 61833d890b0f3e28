"""Sizes in the configurations: plain ints within documented bounds, host memory within the machine's.

Every out-of-bounds size is a ``ValueError`` naming the field, raised when the configuration is built or,
for the sizes the model and the generation imply, before the session allocates them — never a raw
allocator error later.
"""

from __future__ import annotations

import pytest
import torch

from torch_kvoffload import OffloadConfig
from torch_kvoffload.sparse.config import (
    MAX_BLOCK_SIZE,
    MAX_CAPACITY,
    MAX_POOL_ROWS,
    MAX_TOP_K,
    SparseDecodeConfig,
)
from torch_kvoffload.store import LocalKVStore, StoreConfig
from torch_kvoffload.store.sizes import physical_memory_bytes

RAM = physical_memory_bytes()
needs_ram = pytest.mark.skipif(RAM == 0, reason="the OS does not report the physical memory")

_SPARSE = {"top_k": 4, "host_pool_blocks": 8}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", MAX_TOP_K + 1),
        ("top_k", True),
        ("capacity", MAX_CAPACITY + 1),
        ("capacity", True),
        ("block_size", MAX_BLOCK_SIZE + 1),
        ("block_size", True),
        ("block_size", 8.0),
        ("host_pool_blocks", True),
        ("host_pool_blocks", MAX_POOL_ROWS + 1),  # too many rows for any block size
    ],
)
def test_sparse_sizes_out_of_bounds_name_the_field(field, value):
    fields = {**_SPARSE, field: value}
    with pytest.raises(ValueError, match=field):
        SparseDecodeConfig(**fields)
    # the same through OffloadConfig's sparse dict, at configuration time
    with pytest.raises(ValueError, match=field):
        OffloadConfig(sparse={field: value})


def test_sparse_sizes_at_the_bounds_are_accepted():
    cfg = SparseDecodeConfig(
        top_k=MAX_TOP_K, capacity=MAX_CAPACITY, host_pool_blocks=1, block_size=MAX_BLOCK_SIZE
    )
    assert (cfg.top_k, cfg.hot_capacity, cfg.block_size) == (MAX_TOP_K, MAX_CAPACITY, MAX_BLOCK_SIZE)
    assert (
        SparseDecodeConfig(top_k=1, host_pool_blocks=MAX_POOL_ROWS // 128).host_pool_blocks
        == MAX_POOL_ROWS // 128
    )
    with pytest.raises(ValueError, match="host_pool_blocks"):  # the rows, with the default block_size 128
        SparseDecodeConfig(top_k=1, host_pool_blocks=MAX_POOL_ROWS // 128 + 1)


@pytest.mark.parametrize("value", [True, False, 0, MAX_BLOCK_SIZE + 1, 8.0, "8"])
def test_offload_block_size_out_of_bounds(value):
    with pytest.raises(ValueError, match="block_size"):
        OffloadConfig(layerwise={}, block_size=value)
    assert OffloadConfig(layerwise={}, block_size=MAX_BLOCK_SIZE).resolved_block_size == MAX_BLOCK_SIZE


@needs_ram
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"capacity_bytes": RAM + 1}, "capacity_bytes"),
        ({"capacity_bytes": f"{RAM // 2**30 + 1}GiB"}, "capacity_bytes"),
        ({"kind": "mooncake", "capacity_bytes": RAM + 1}, "capacity_bytes"),  # the default segment
        ({"kind": "mooncake", "global_segment_size": RAM + 1}, "global_segment_size"),
        ({"kind": "mooncake", "local_buffer_size": RAM + 1}, "local_buffer_size"),
    ],
)
def test_store_host_memory_beyond_physical_memory(options, field):
    if options.get("kind") == "mooncake":
        options = {**options, "master_server_addr": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/m"}
    with pytest.raises(ValueError, match=field):
        StoreConfig(**options)
    with pytest.raises(ValueError, match=field):
        OffloadConfig(layerwise={"store": options})


@needs_ram
def test_store_sizes_within_memory_and_remote_shares():
    assert StoreConfig(capacity_bytes=RAM).capacity_bytes == RAM  # not allocated by a config
    # a memcache client's share lives in the remote pool: no local bound
    assert StoreConfig(kind="memcache", capacity_bytes=RAM * 4).capacity_bytes == RAM * 4
    with pytest.raises(ValueError, match="capacity_bytes"):
        LocalKVStore(RAM + 1)  # before any allocation


@pytest.mark.parametrize(
    "field", ["alignment", "replica_num", "setup_retries", "device_id", "capacity_bytes"]
)
def test_store_int_options_reject_bools(field):
    kind = {"replica_num": "mooncake", "setup_retries": "mooncake", "device_id": "memcache"}.get(
        field, "local"
    )
    extra = (
        {"master_server_addr": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/m"}
        if kind == "mooncake"
        else {}
    )
    with pytest.raises(ValueError, match=field):
        StoreConfig(kind=kind, **extra, **{field: True})


@needs_ram
def test_host_pool_implied_by_the_model_is_checked_before_allocation():
    pytest.importorskip("transformers")
    from support.hf_models import build_model

    import torch_kvoffload

    blocks = MAX_POOL_ROWS // 8  # within the row bound, far beyond memory for 4 layers x 80 fp32 columns
    model = torch_kvoffload.offload(
        build_model("deepseek_v32"), {"sparse": {"host_pool_blocks": blocks, "block_size": 8}}
    )
    ids = torch.randint(3, 1000, (1, 12))
    with pytest.raises(ValueError, match="host_pool_blocks"):
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    # a configuration the machine can hold works on the same kind of model afterwards
    model = torch_kvoffload.offload(
        build_model("deepseek_v32"), {"sparse": {"host_pool_blocks": 16}, "block_size": 8}
    )
    assert model.generate(input_ids=ids, max_new_tokens=2, do_sample=False).shape == (1, 14)
