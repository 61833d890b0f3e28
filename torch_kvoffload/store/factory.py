"""Build a host KV store from a validated :class:`StoreConfig` (or keyword options).

>>> store = create_store("local", capacity_bytes="64MiB")
>>> store.capacity_bytes
67108864
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from torch_kvoffload.config import ConfigModel
from torch_kvoffload.store.base import KVStore
from torch_kvoffload.store.sizes import check_host_bytes, parse_bytes

__all__ = ["StoreConfig", "build_store", "create_store"]

_LOCAL = {"alignment", "pin_memory"}
_MOONCAKE = {
    "master_server_addr",
    "metadata_server",
    "local_hostname",
    "protocol",
    "rdma_devices",
    "global_segment_size",
    "local_buffer_size",
    "replica_num",
    "setup_retries",
}
_MEMCACHE = {"device_id", "config_path", "init_bm"}
_OWNER = {
    **dict.fromkeys(_LOCAL, "local"),
    **dict.fromkeys(_MOONCAKE, "mooncake"),
    **dict.fromkeys(_MEMCACHE, "memcache"),
}


class StoreConfig(ConfigModel):
    """Which host KV pool to use and its options.

    ``capacity_bytes`` applies to every kind (for the remote kinds: this client's share). Every other
    option belongs to one kind; setting it for another kind is an error.

    Sizes are checked against what this machine can allocate: the host memory a store takes here — the
    ``local`` arena (``capacity_bytes``), the segment a ``mooncake`` client lends (``global_segment_size``,
    by default ``max(capacity_bytes, 16 MiB)``) and its ``local_buffer_size`` — may not exceed the
    physical memory (:func:`~torch_kvoffload.store.sizes.physical_memory_bytes`); a ``ValueError`` names
    the field. Integer options are plain ints (a bool is rejected); byte sizes also take strings such as
    ``"4GiB"``.
    """

    kind: Literal["local", "mooncake", "memcache"] = "local"
    capacity_bytes: int = Field(default=1 << 30, gt=0)
    # local
    alignment: StrictInt = Field(default=1, ge=1)
    pin_memory: bool | None = None
    # mooncake
    master_server_addr: str | None = None
    metadata_server: str | None = None
    local_hostname: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = ""
    global_segment_size: int | None = Field(default=None, ge=0)
    local_buffer_size: int = Field(default=16 << 20, ge=0)
    replica_num: StrictInt = Field(default=1, ge=1)
    setup_retries: StrictInt | None = Field(default=None, ge=1)
    # memcache
    device_id: StrictInt = Field(default=0, ge=0)
    config_path: str | None = None
    init_bm: bool = True

    @field_validator("capacity_bytes", "global_segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _bytes(cls, value: Any, info: Any) -> Any:
        return None if value is None else parse_bytes(info.field_name, value)

    @field_validator("alignment")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"alignment must be a power of two, got {value}")
        return value

    @model_validator(mode="after")
    def _check_kind(self) -> StoreConfig:
        foreign = sorted(f for f in self.model_fields_set if _OWNER.get(f, self.kind) != self.kind)
        if foreign:
            owners = ", ".join(f"{f} ({_OWNER[f]})" for f in foreign)
            raise ValueError(f"store kind {self.kind!r} does not take: {owners}")
        if self.kind == "mooncake" and (not self.master_server_addr or not self.metadata_server):
            raise ValueError("store kind 'mooncake' needs master_server_addr and metadata_server")
        if self.kind == "local":
            check_host_bytes("StoreConfig", "capacity_bytes", self.capacity_bytes)
        if self.kind == "mooncake":
            if self.global_segment_size is None:
                check_host_bytes(
                    "StoreConfig", "capacity_bytes (the default global_segment_size)", self.capacity_bytes
                )
            else:
                check_host_bytes("StoreConfig", "global_segment_size", self.global_segment_size)
            check_host_bytes("StoreConfig", "local_buffer_size", self.local_buffer_size)
        return self


def build_store(config: StoreConfig) -> KVStore:
    """Instantiate the store ``config`` describes (optional packages are imported only here)."""
    if config.kind == "local":
        from torch_kvoffload.store.local import LocalKVStore

        return LocalKVStore(config.capacity_bytes, alignment=config.alignment, pin_memory=config.pin_memory)
    if config.kind == "mooncake":
        from torch_kvoffload.store.mooncake import MooncakeKVStore

        assert config.master_server_addr is not None and config.metadata_server is not None
        return MooncakeKVStore(
            config.capacity_bytes,
            master_server_addr=config.master_server_addr,
            metadata_server=config.metadata_server,
            local_hostname=config.local_hostname,
            protocol=config.protocol,
            rdma_devices=config.rdma_devices,
            global_segment_size=config.global_segment_size,
            local_buffer_size=config.local_buffer_size,
            replica_num=config.replica_num,
            setup_retries=config.setup_retries,
        )
    from torch_kvoffload.store.memcache import MemcacheKVStore

    return MemcacheKVStore(
        config.capacity_bytes,
        device_id=config.device_id,
        config_path=config.config_path,
        init_bm=config.init_bm,
    )


def create_store(kind: str = "local", **options: Any) -> KVStore:
    """``create_store("local", capacity_bytes="4GiB")`` — validate with :class:`StoreConfig`, then build.

    Raises ``ValueError`` (pydantic's ``ValidationError`` is one) for an unknown kind, an option of
    another kind, or a missing required option.
    """
    return build_store(StoreConfig(kind=kind, **options))
