"""KVPP hooks: ``kvpp_wait_layer`` for a layer, then ``kvpp_prefetch_layer`` for the next one, before
the layer's first KV access (after its projections).

The wait blocks until the owner's broadcast of the layer's bundle landed in this rank's buffer; the
prefetch starts the next layer's broadcast so it overlaps this layer's compute (the scheduler ignores
layers that are not its next target, so asking is always safe). Both take the caches they order as
mutated arguments: the broadcast writes them.
"""

from __future__ import annotations

import torch.fx as fx

from torch_kvoffload.passes import _graph as g
from torch_kvoffload.passes._ops import op
from torch_kvoffload.passes.context import PassContext

__all__ = ["KVPPHooksPass"]


class KVPPHooksPass:
    """Insert the KVPP scheduler's wait / next-layer prefetch nodes before each layer's KV accesses."""

    name = "kvpp_hooks"

    def uuid(self) -> str:
        return "kvoffload.kvpp_hooks.v1"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> list[g.PassRecord]:
        if ctx.kvpp_scheduler is None:
            return []
        wait, prefetch = op("kvpp_wait_layer"), op("kvpp_prefetch_layer")
        graph = gm.graph

        def insert(layer: int, first: fx.Node, last: fx.Node, nxt: int | None) -> tuple[list[fx.Node], str]:
            caches = g.layer_cache_nodes(gm, layer, ctx.caches_of(layer))
            with graph.inserting_before(first):
                new = [graph.call_function(wait, (ctx.kvpp_scheduler, layer, caches))]
                if nxt is not None:
                    nxt_caches = g.layer_cache_nodes(gm, nxt, ctx.caches_of(nxt))
                    new.append(graph.call_function(prefetch, (ctx.kvpp_scheduler, nxt, nxt_caches)))
            what = "kvpp_wait_layer" + (f" + kvpp_prefetch_layer({nxt})" if nxt is not None else "")
            return new, f"{what} before {first.name} (scheduler {ctx.kvpp_scheduler!r})"

        return g.insert_layer_hooks(gm, self.name, wait, insert, runtime_runs_hooks=ctx.runtime_runs_hooks)
