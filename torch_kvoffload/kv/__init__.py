"""What a model's KV is to a backend: the types the KV core and every feature's backend speak.

* :mod:`~torch_kvoffload.kv.spec`: ``ModelSpec`` (what the core knows of a model);
* :mod:`~torch_kvoffload.kv.requests`: requests with independent lifetimes and their device slots;
  :mod:`~torch_kvoffload.kv.layout`: the sizes the device caches are allocated for;
  :mod:`~torch_kvoffload.kv.forward`: the index tensors of one forward;
* :mod:`~torch_kvoffload.kv.backend`: the ``KVBackend`` interface and the rows it is given and gives back;
* :mod:`~torch_kvoffload.kv.paged`: per-slot paged device caches; :mod:`~torch_kvoffload.kv.totals`:
  counters summed over a backend's runtimes; :mod:`~torch_kvoffload.kv.group_outcomes`: one outcome agreed
  by every rank of a tensor-parallel group.

Each feature's backend lives in its own package (``layerwise.backend``, ``sparse.backend``,
``sparse.resident_backend``, ``kvpp.backend``) and imports only these types from here; the KV core
(:mod:`torch_kvoffload.core`) builds them from the configuration and calls them.
"""
