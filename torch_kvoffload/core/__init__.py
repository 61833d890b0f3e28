"""The request-level KV core: what an offloaded model's KV is, independent of any model library."""
