"""The KV backend interface: one feature's way of keeping a model's KV, behind one small set of methods.

A :class:`~torch_kvoffload.core.kv.KVCore` owns the requests and the sizes and calls its backends (one per
enabled feature, chosen once from the configuration: layerwise, sparse offload, resident sparse, KVPP, and a
P/D role) in a fixed order. Per forward it calls ``begin_forward`` / ``end_forward`` of the backends that
take part; per layer ``write`` the new rows to each, then attention: the first backend whose ``attend``
returns a result (sparse offload's decode step) decides it, otherwise the core attends over the ``keys`` of
the first backend that has them, selecting with the indexer of the backend that owns the indexer cache.

Shapes: ``N`` rows of the forward (its real tokens, request-major), ``H`` heads, ``Dc`` the latent width
(``kv_lora_rank``), ``Dr`` the rotary width, ``Hi`` / ``Di`` the indexer's heads and width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from torch_kvoffload.ops.fp8_indexer import fp8_lightning_indexer, hadamard_quant_fp8
from torch_kvoffload.ops.indexer import hadamard_quant_int8, lightning_indexer, quant_lightning_indexer

if TYPE_CHECKING:
    import torch

    from torch_kvoffload.kv.forward import ForwardPlan
    from torch_kvoffload.kv.layout import KVLayout
    from torch_kvoffload.kv.requests import Request

__all__ = [
    "ROW_PARTS", "IndexerView", "KVBackend", "KeyRows", "NewRows", "Queries", "SelectedRows", "row_parts",
]  # fmt: skip

#: The components of a layer's rows :meth:`KVBackend.read` gives back: the latent, the rotary key, the
#: indexer key.
ROW_PARTS = ("kv_c", "k_pe", "index_k")


def row_parts(kv_fp8: bool, indexed: bool) -> tuple[str, ...]:
    """The components a layer's cache keeps, in order, of :data:`ROW_PARTS`: FP8 latent rows hold the rotary
    part (no ``k_pe``); ``index_k`` when the cache carries the indexer keys."""
    return ("kv_c",) + (() if kv_fp8 else ("k_pe",)) + (("index_k",) if indexed else ())


class NewRows(NamedTuple):
    """A layer's new rows in one forward: ``kv_c [N, Dc]`` and ``k_pe [N, Dr]`` in the model's dtype,
    ``index_k [N, Di]`` (models with an indexer) or ``None``."""

    kv_c: torch.Tensor
    k_pe: torch.Tensor
    index_k: torch.Tensor | None


class Queries(NamedTuple):
    """A layer's queries in one forward: absorbed ``q_nope [N, H, Dc]``, ``q_pe [N, H, Dr]``, the indexer's
    ``index_q [N, Hi, Di]`` and fp32 ``index_weights [N, Hi]`` (or both ``None``), the softmax ``scale``."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    index_q: torch.Tensor | None
    index_weights: torch.Tensor | None
    scale: float


class KeyRows(NamedTuple):
    """Rows attention reads: ``kv_c [R, Dc]``, ``k_pe [R, Dr]``; request ``r`` of the forward (batch row)
    has its logical position ``p`` at row ``starts[r] + p``. ``fp8``: ``kv_c`` holds DeepSeek's FP8 rows
    ``uint8 [R, Dc + 4 * Dc / 128 + 2 * Dr]`` (latent and RoPE values together) and ``k_pe`` is empty."""

    kv_c: torch.Tensor
    k_pe: torch.Tensor
    starts: list[int]
    fp8: bool = False


class SelectedRows(NamedTuple):
    """The rows a backend's own sparse attention read for each of ``N`` queries: ``positions int64 [N, K]``
    (logical positions in the query's request, ``−1``: no row) and their ``kv_c [N, K, Dc]`` / ``k_pe [N, K,
    Dr]`` (any values where the position is ``−1``)."""

    positions: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor


class IndexerView(NamedTuple):
    """A layer's device indexer cache as the lightning indexer reads it: ``caches`` = ``(keys [pages,
    page, Di],)`` in a floating dtype (``fmt`` ``"bf16"``), ``(int8 keys, fp32 scales [pages, page])``
    (``"int8"``) or ``(uint8 FP8 rows [pages, page, Di + 4 * Di / 128],)`` (``"fp8_e4m3"``); ``block_table
    int32 [B, pages per request]`` of the forward's requests; ``top_k`` to select."""

    caches: tuple[torch.Tensor, ...]
    block_table: torch.Tensor
    top_k: int
    fmt: str = "bf16"

    def select(
        self, index_q: torch.Tensor, weights: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``int32 [N, top_k]``: the top-k logical positions (−1 padded) of queries ``index_q [N, Hi, Di]`` /
        ``weights fp32 [N, Hi]`` of requests ``cu_seqlens_q int32 [B + 1]`` over their first ``seq_lens_k
        int32 [B]`` rows, through ``block_table`` (default: the view's), quantizing the queries as the
        cache's format is."""

        table = self.block_table if block_table is None else block_table
        args = (table, cu_seqlens_q, seq_lens_k, self.top_k)
        if self.fmt == "int8":
            q8, qs = hadamard_quant_int8(index_q)
            return quant_lightning_indexer(q8, qs, weights, *self.caches, *args)
        if self.fmt == "fp8_e4m3":
            return fp8_lightning_indexer(hadamard_quant_fp8(index_q), weights, *self.caches, *args)
        keys = self.caches[0]
        return lightning_indexer(index_q.to(keys.dtype), weights, keys, *args)


class KVBackend:
    """One feature's KV (see the module docstring). Every method but :meth:`fork` / :meth:`truncate` has a
    neutral default, so a backend defines only what its feature does.

    Sizing: :meth:`resize` allocates for a layout (``live`` empty) or grows the caches of live requests in
    place (``live`` the running requests, whose rows are kept); :meth:`can_grow` says whether growth to a
    layout is possible at all (checked for every backend before any changes); :meth:`free` drops the
    device caches (:attr:`built` is then false). Requests: :meth:`admit` / :meth:`release`, :meth:`fork` /
    :meth:`truncate` (no neutral default: a backend says what it does). Forwards:
    :meth:`takes_part`, :meth:`begin_forward`, :meth:`end_forward`, :meth:`abort_forward` (a forward that
    raised: end it, its own error is the one reported). Per layer: :meth:`layer_caches` (the tensors every
    op of the layer takes, declared mutated), :meth:`write`, :meth:`keys`, :meth:`indexer`, :meth:`attend`
    (and :meth:`attended`, the rows it read).
    Reading a layer's history back (the Hugging Face cache's ``layers[i].keys``): :meth:`read`.
    Accounting: :meth:`device_tensors`, :meth:`stats`. :meth:`close` releases everything.
    """

    #: short name used in logs
    name = "backend"

    # -------------------------------------------------------------------------------- sizing
    @property
    def built(self) -> bool:
        """Whether the backend holds caches for the current layout."""
        return True

    def can_grow(self, layout: KVLayout, live: Sequence[Request]) -> bool:
        """Whether ``live`` requests can continue in ``layout`` (more tokens each) without a new sequence."""
        return True

    def resize(self, layout: KVLayout, live: Sequence[Request]) -> None:
        """Caches for ``layout``; rows of the ``live`` requests are kept (growth in place)."""

    def free(self) -> None:
        """Drop the device caches (the requests' rows with them)."""

    # ------------------------------------------------------------------------------ requests
    def admit(self, layout: KVLayout, requests: Sequence[Request]) -> None:
        """New ``requests`` (no tokens yet) start."""

    def release(self, request_ids: Sequence[int]) -> None:
        """Requests end; what they hold is freed."""

    def received(self, request: Request, length: int) -> None:
        """``request``'s first ``length`` rows were computed elsewhere and are being placed in this backend's
        host pool and indexer blocks by a transfer (a P/D decode node, before its first forward)."""

    def fork(self, layout: KVLayout, src: Request, dst: Request, length: int) -> None:
        """``dst`` (admitted, no tokens yet) continues ``src``: from now on it holds ``src``'s first
        ``length`` rows as its own (all of them: beam search, ``num_return_sequences``; fewer: a new request
        whose prompt starts with a running one's tokens, :mod:`torch_kvoffload.core.prefix`). Later writes
        to either do not show in the other. Called between forwards; the core then gives ``dst`` those of
        ``src``'s tokens. A backend that keeps no per-request KV has nothing to do; one that cannot fork raises
        ``NotImplementedError`` naming the feature (nothing changed)."""
        raise NotImplementedError(
            f"{self.name}: forking a request (beam search, batch expansion) is not supported"
        )

    def truncate(self, request: Request, length: int) -> None:
        """``request`` drops its rows from logical position ``length`` on (``0 <= length <=
        request.length``; ``request.length`` is still the old length when called): the next forward
        continues at ``length`` and nothing of the dropped rows may show in any later result (assisted
        decoding's rejected tokens). Called between forwards."""
        raise NotImplementedError(f"{self.name}: truncating a request (cache cropping) is not supported")

    # ------------------------------------------------------------------------------ forwards
    def takes_part(self, fwd: ForwardPlan) -> bool:
        """Whether forward ``fwd`` runs through this backend."""
        return True

    def begin_forward(self, fwd: ForwardPlan) -> None:
        """Before the layers of ``fwd`` run."""

    def end_forward(self, fwd: ForwardPlan) -> None:
        """After every layer of ``fwd`` ran; raises the first failure of its transfers."""

    def abort_forward(self, fwd: ForwardPlan) -> None:
        """``fwd`` raised: end what :meth:`begin_forward` started."""
        self.end_forward(fwd)

    # ------------------------------------------------------------------------------- per layer
    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        """The device tensors of ``layer`` every op of the layer takes (declared mutated by the ops)."""
        return []

    def before_write(self, layer: int, fwd: ForwardPlan) -> None:
        """Before ``layer``'s rows of ``fwd`` are written (after its projections): wait until the layer's
        KV may be used (a load, a broadcast) and start what the next layers need."""

    def write(self, layer: int, fwd: ForwardPlan, rows: NewRows) -> None:
        """Keep ``layer``'s new rows of ``fwd``."""

    def after_write(self, layer: int, fwd: ForwardPlan) -> None:
        """After ``layer``'s rows of ``fwd`` were written by every backend (start saving them)."""

    def keys(self, layer: int, fwd: ForwardPlan) -> KeyRows | None:
        """The rows ``layer``'s attention of ``fwd`` reads, if this backend holds them."""
        return None

    def indexer(self, layer: int, fwd: ForwardPlan) -> IndexerView | None:
        """``layer``'s indexer cache, if this backend owns the model's indexer cache."""
        return None

    def attend(self, layer: int, fwd: ForwardPlan, q: Queries) -> torch.Tensor | None:
        """``out [N, H, Dc]`` when this backend runs ``layer``'s whole attention of ``fwd`` itself."""
        return None

    def attended(self, layer: int, fwd: ForwardPlan) -> SelectedRows | None:
        """Right after :meth:`attend` returned a result for ``layer`` of ``fwd``: the rows that attention
        read, for its probabilities (Hugging Face's ``output_attentions``); ``None`` when this backend has
        no attention of its own."""
        return None

    def read(
        self, layer: int, requests: Sequence[Request], part: str, start: int = 0, *, stored: bool = False
    ) -> list[torch.Tensor] | None:
        """Per request, its rows ``start .. length - 1`` of ``layer``'s component ``part`` (one of
        :data:`ROW_PARTS`: ``"kv_c" [n, Dc]``, ``"k_pe" [n, Dr]``, ``"index_k" [n, Di]``) exactly as written,
        as new tensors on the compute device in the model's dtype; ``None`` when this backend does not keep
        that component's whole history. Between forwards; it copies every row it returns. Raises
        ``RuntimeError`` naming the reason when it keeps them but cannot give them back exactly (a lossy
        format, rows no longer held). ``stored``: the rows as the backend keeps them instead (an FP8
        indexer cache's ``uint8`` rows, for a store that keeps them so)."""
        return None

    # ------------------------------------------------------------------------------ accounting
    def device_tensors(self) -> list[torch.Tensor]:
        """Every KV tensor the backend holds now (those on the compute device are counted)."""
        return []

    def stats(self) -> dict[str, float]:
        """Counters by name (the core sums them over its backends: ``KVCore.backend_stats``)."""
        return {}

    def close(self) -> None:
        """Release everything (idempotent)."""
        self.free()
