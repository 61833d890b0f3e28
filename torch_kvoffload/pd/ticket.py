"""``TransferTicket``: what decode tells prefill (through the router) about one request's destinations."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch_kvoffload._utils import check_int

__all__ = ["TicketPart", "TransferTicket"]


@dataclass(frozen=True)
class TicketPart:
    """One decode TP rank's destinations of a request: its indexer blocks and the generation under which
    the destinations were allocated (:meth:`DecodeReceiver.expect`)."""

    d_rank: int
    generation: int
    indexer_blocks: tuple[int, ...]


@dataclass(frozen=True)
class TransferTicket:
    """Destinations of request ``request_id`` on decode DP rank ``dp_rank``.

    ``main_blocks``: host-pool blocks (shared by the DP rank's TP ranks) of positions ``0..num_tokens-1``;
    ``parts[t]``: decode TP rank ``t``'s indexer blocks and generation.
    """

    request_id: int
    num_tokens: int
    dp_rank: int
    main_blocks: tuple[int, ...]
    parts: tuple[TicketPart, ...]

    @classmethod
    def combine(
        cls, request_id: int, num_tokens: int, dp_rank: int, main_blocks, parts: list[TicketPart]
    ) -> TransferTicket:
        """The ticket of the parts every decode TP rank of ``dp_rank`` returned (in any order)."""
        parts = sorted(parts, key=lambda p: p.d_rank)
        if [p.d_rank for p in parts] != list(range(len(parts))):
            raise ValueError(
                f"TransferTicket.combine: parts of ranks {[p.d_rank for p in parts]}, expected 0..n-1"
            )
        for p in parts:
            if len(p.indexer_blocks) not in (0, len(main_blocks)):
                raise ValueError(
                    f"TransferTicket.combine: rank {p.d_rank} has {len(p.indexer_blocks)} indexer blocks for "
                    f"{len(main_blocks)} main blocks"
                )
        return cls(request_id, num_tokens, dp_rank, tuple(main_blocks), tuple(parts))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransferTicket:
        parts = tuple(
            TicketPart(p["d_rank"], p["generation"], tuple(p["indexer_blocks"])) for p in d["parts"]
        )
        for name in ("request_id", "num_tokens", "dp_rank"):
            check_int("TransferTicket.from_dict", name, d[name], minimum=0)
        return cls(d["request_id"], d["num_tokens"], d["dp_rank"], tuple(d["main_blocks"]), parts)
