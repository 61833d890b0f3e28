"""Layerwise offload hooks: ``layer_wait`` + ``layer_prefetch`` before a layer's first KV access,
``layer_save`` after its last cache write.

The first KV access of a layer is its ``mla_cache_write`` (after the absorb pass) or its first cache
append: it comes after the layer's projections, so the projections of layer ``i`` overlap the load of
layer ``i``'s prefix that ``layer_prefetch`` of layer ``i - 1`` issued. The ops take the layer's cache
tensors (graph inputs, see ``passes._graph``) as mutated arguments, which keeps them ordered against
every other op on those tensors and safe from dead-code elimination.
"""

from __future__ import annotations

import torch.fx as fx

from torch_kvoffload.passes import _graph as g
from torch_kvoffload.passes._ops import op
from torch_kvoffload.passes.context import PassContext

__all__ = ["LayerwiseHooksPass"]


class LayerwiseHooksPass:
    """Insert the layerwise runtime's wait / prefetch / save nodes around each layer's KV accesses."""

    name = "layerwise_hooks"

    def uuid(self) -> str:
        return "kvoffload.layerwise_hooks.v1"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> list[g.PassRecord]:
        if ctx.layerwise_runtime is None:
            return []
        wait, prefetch, save = op("layer_wait"), op("layer_prefetch"), op("layer_save")
        graph = gm.graph

        def insert(layer: int, first: fx.Node, last: fx.Node, nxt: int | None) -> tuple[list[fx.Node], str]:
            caches = g.layer_cache_nodes(gm, layer, ctx.caches_of(layer))
            args = (ctx.layerwise_runtime, layer, caches)
            with graph.inserting_before(first):
                new = [graph.call_function(wait, args), graph.call_function(prefetch, args)]
            with graph.inserting_after(last):
                new.append(graph.call_function(save, args))
            detail = (
                f"layer_wait + layer_prefetch before {first.name}, layer_save after {last.name} "
                f"(runtime {ctx.layerwise_runtime!r})"
            )
            return new, detail

        return g.insert_layer_hooks(gm, self.name, wait, insert, runtime_runs_hooks=ctx.runtime_runs_hooks)
