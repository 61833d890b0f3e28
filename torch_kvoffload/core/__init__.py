"""The request-level KV core: what an offloaded model's KV is, independent of any model library.

* :mod:`~torch_kvoffload.core.config`: ``OffloadConfig`` (which features run, and how);
  :mod:`~torch_kvoffload.core.spec`: ``ModelSpec`` (what the core knows of a model);
* :mod:`~torch_kvoffload.core.requests`: requests with independent lifetimes and their device slots;
  :mod:`~torch_kvoffload.core.layout`: the sizes the device caches are allocated for;
  :mod:`~torch_kvoffload.core.forward`: the index tensors of one forward;
* :mod:`~torch_kvoffload.core.kv_backend`: the ``KVBackend`` interface (and the ``PDRole`` one);
  :mod:`~torch_kvoffload.core.backends`: one backend per feature (layerwise, sparse offload, resident
  sparse, KVPP), chosen from the configuration's types;
* :mod:`~torch_kvoffload.core.kv`: ``KVCore``, which owns the requests and sizes and dispatches to the
  backends; :mod:`~torch_kvoffload.core.attention`: absorbed MLA attention over what a backend holds;
  :mod:`~torch_kvoffload.core.paged`: per-slot paged device caches.

Model libraries adapt to it (``integrations.hf`` for Hugging Face ``transformers``).
"""
