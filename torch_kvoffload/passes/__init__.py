"""FX passes that wire a captured MLA / DSA model graph to the offload runtimes.

One pass per module, ordered by :class:`OffloadPassManager`:

* :mod:`~torch_kvoffload.passes.analysis` — finds, per layer, cache inputs and writes, the latent
  up-projection, the indexer top-k and the attention call (from the graph alone);
* :mod:`~torch_kvoffload.passes.absorb` — rewrites each layer onto absorbed MLA
  (``mla_cache_write`` + ``mla_cache_attention``);
* :mod:`~torch_kvoffload.passes.layerwise` — layerwise ``layer_wait`` / ``layer_prefetch`` / ``layer_save``;
* :mod:`~torch_kvoffload.passes.kvpp` — KVPP ``kvpp_wait_layer`` / ``kvpp_prefetch_layer``.
"""

from torch_kvoffload.passes._graph import CACHE_INPUTS_KEY, RECORDS_KEY, PassRecord, records
from torch_kvoffload.passes.absorb import AbsorbMLAPass
from torch_kvoffload.passes.analysis import CacheWrite, GraphAnalysis, IndexerSites, LayerSites, analyze_graph
from torch_kvoffload.passes.context import PassContext
from torch_kvoffload.passes.kvpp import KVPPHooksPass
from torch_kvoffload.passes.layerwise import LayerwiseHooksPass
from torch_kvoffload.passes.manager import OffloadPass, OffloadPassManager, PassReport, default_passes

__all__ = [
    "CACHE_INPUTS_KEY",
    "RECORDS_KEY",
    "AbsorbMLAPass",
    "CacheWrite",
    "GraphAnalysis",
    "IndexerSites",
    "KVPPHooksPass",
    "LayerSites",
    "LayerwiseHooksPass",
    "OffloadPass",
    "OffloadPassManager",
    "PassContext",
    "PassRecord",
    "PassReport",
    "analyze_graph",
    "default_passes",
    "records",
]
