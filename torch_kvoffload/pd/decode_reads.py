"""Decode side of P/D transfer: turn one LAYER_READY batch into the read ops that pull it, or say why not.

Validation is complete before any read: the batch must belong to the live requests it names (generation,
state, layer not yet received, the connection that delivered the request's earlier layers, an exported
physical buffer) — else :class:`Refuse` (answered, fails nothing) —, and must describe what the
destinations expect (member and ratio, layer, main tensor count and block sizes, indexer presence and
sizes — the int8 scale included —, destination blocks equal to the ones allocated, source blocks inside
the peer's buffers) — else :class:`Reject` (fails the requests it names).
"""

from __future__ import annotations

from torch_kvoffload.pd.config import split_range
from torch_kvoffload.pd.decode_destinations import Destinations
from torch_kvoffload.pd.decode_state import PENDING, ExpectedRequest, PrefillPeer
from torch_kvoffload.pd.messages import LayerReady
from torch_kvoffload.pd.transports import ReadOp

__all__ = ["Refuse", "Reject", "plan_reads"]


class Reject(Exception):
    """The batch fails the requests it names."""


class Refuse(Reject):
    """The batch is not the named live requests' own (stale, replayed, foreign): refuse it, fail nothing."""


def plan_reads(
    dest: Destinations,
    ratio: int,
    identity: bytes,
    peer: PrefillPeer,
    msg: LayerReady,
    reqs: list[ExpectedRequest | None],
) -> tuple[list[ReadOp], list[tuple[int, list[int]]]]:
    """The reads of batch ``msg`` from ``peer`` (over connection ``identity``) for ``reqs`` (the live
    request each entry names, ``None`` if none; their locks held), and the staged indexer blocks
    ``(component, blocks)`` to land afterwards. ``ratio``: prefill ranks per decode rank. Raises
    :class:`Refuse` or :class:`Reject`."""
    if len({e.request_id for e in msg.entries}) != len(msg.entries):
        raise Refuse(f"a request appears twice in the batch: {[e.request_id for e in msg.entries]}")
    for entry, req in zip(msg.entries, reqs, strict=True):
        rid = entry.request_id
        if req is None or req.generation != entry.generation:
            raise Refuse(
                f"request {rid} generation {entry.generation} is not expected here (stale or unknown)"
            )
        if req.state != PENDING:
            raise Refuse(f"request {rid} is {req.state} ({req.error})")
        if (msg.layer, peer.member) in req.done:
            raise Refuse(f"request {rid}: layer {msg.layer} of member {peer.member} arrived twice")
        if req.sources.get(peer.member, identity) != identity:
            raise Refuse(f"request {rid}: member {peer.member}'s earlier layers came over another connection")
    if not 0 <= msg.slot < len(peer.slots):
        raise Refuse(f"physical buffer {msg.slot} out of range [0, {len(peer.slots)})")
    if msg.member != peer.member or msg.ratio != ratio:
        raise Reject(f"member {msg.member} / ratio {msg.ratio}, expected {peer.member} / {ratio}")
    if not 0 <= msg.layer < dest.num_layers:
        raise Reject(f"layer {msg.layer} out of range [0, {dest.num_layers})")
    main_bytes = dest.main_block_bytes
    if list(msg.main_block_bytes) != main_bytes:
        raise Reject(
            f"main KV metadata: {len(msg.main_block_bytes)} tensors of block bytes {msg.main_block_bytes}, "
            f"the destination has {len(main_bytes)} of {main_bytes}"
        )
    want_idx = dest.indexer_block_bytes(msg.layer)
    if list(msg.indexer_block_bytes) != want_idx:
        raise Reject(
            f"indexer metadata: block bytes {msg.indexer_block_bytes or 'none'}, the destination has "
            f"{want_idx or 'no indexer'} (presence, size and int8 scale layout must match)"
        )
    slot = peer.slots[msg.slot]
    main_regions, idx_regions = list(slot.get("main", [])), list(slot.get("indexer", []))
    if len(main_regions) != len(main_bytes) or (want_idx and len(idx_regions) != len(want_idx)):
        raise Reject(
            f"physical buffer {msg.slot} exports {len(main_regions)} main / {len(idx_regions)} indexer regions"
        )
    ops: list[ReadOp] = []
    staged: list[tuple[int, list[int]]] = []
    for entry, req in zip(msg.entries, reqs, strict=True):
        assert req is not None  # checked above
        rid = entry.request_id
        want_main = req.main_share if peer.member == 0 else []
        if list(entry.main_dst) != want_main or len(entry.main_src) != len(entry.main_dst):
            raise Reject(
                f"request {rid}: main destination blocks {entry.main_dst} (from {len(entry.main_src)} sources), "
                f"expected {want_main}"
            )
        lo, hi = split_range(len(req.indexer_blocks), ratio, peer.member)
        want_idx_blocks = req.indexer_blocks[lo:hi] if want_idx else []
        if list(entry.indexer_dst) != want_idx_blocks or len(entry.indexer_src) != len(entry.indexer_dst):
            raise Reject(
                f"request {rid}: indexer destination blocks {entry.indexer_dst} (from "
                f"{len(entry.indexer_src)} sources), expected {want_idx_blocks}"
            )
        for b in (*entry.main_src, *entry.indexer_src):
            if not 0 <= b < peer.num_blocks:
                raise Reject(f"request {rid}: source block {b} outside the peer's {peer.num_blocks} blocks")
        for c, n in enumerate(main_bytes):
            ops += _runs(main_regions[c], dest.main_region(msg.layer, c), entry.main_src, entry.main_dst, n)
        for c, n in enumerate(want_idx):
            local = dest.indexer_region(msg.layer, c)
            ops += _runs(idx_regions[c], local, entry.indexer_src, entry.indexer_dst, n)
            if dest.is_staged(c) and entry.indexer_dst:
                staged.append((c, list(entry.indexer_dst)))
    return ops, staged


def _runs(remote: str, local: str, src: list[int], dst: list[int], n: int) -> list[ReadOp]:
    """Read ops for blocks ``src[i] -> dst[i]`` of ``n`` bytes each, merging runs consecutive on both sides."""
    ops: list[ReadOp] = []
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        ops.append(ReadOp(remote, src[i] * n, local, dst[i] * n, (j - i) * n))
        i = j
    return ops
