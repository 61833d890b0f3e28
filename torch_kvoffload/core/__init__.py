"""The request-level KV core: what an offloaded model's KV is, independent of any model library.

* :mod:`~torch_kvoffload.core.config`: ``OffloadConfig`` (which features run, and how);
* :mod:`~torch_kvoffload.core.backends`: :func:`build_backends`, which picks one backend per enabled
  feature from the configuration's types (the backends live in their features' packages and speak the
  types of :mod:`torch_kvoffload.kv`); :mod:`~torch_kvoffload.core.pd_role`: the ``PDRole`` interface a
  disaggregated node's integration implements;
* :mod:`~torch_kvoffload.core.kv`: ``KVCore``, which owns the requests and sizes and dispatches to the
  backends; :mod:`~torch_kvoffload.core.layer`: one layer's write and attention;
  :mod:`~torch_kvoffload.core.attention`: absorbed MLA attention over what a backend holds.

Model libraries adapt to it (``integrations.hf`` for Hugging Face ``transformers``).
"""
