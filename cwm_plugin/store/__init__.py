"""KV block store: encoded blocks under opaque keys, over CPU memory, local disk and Redis.

* ``config.StoreConfig``: the settings (dict / YAML / ``CWM_STORE_*`` environment).
* ``blob/``: the blob format -- ``codec`` (tensor <-> self-describing, checksummed
  safetensors+zstd blob), ``container`` (its header, without torch), ``crypto`` (encryption
  at rest), ``address`` (content ids).
* ``kv_store.KVStore``: the store the connector and the windows engine use, composed of its
  tiers (``tier_set.TierSet``: also what ``cwm store gc|usage`` opens alone), its saves
  (``write_path``, over the bounded ``save_queue``), its reads (``read_path``) and its batch
  key operations -- presence, delete, link, per-key pins and leases (``key_ops``); what binds a
  blob to its key in ``binding``.
* ``tiers/``: ``ram`` (LRU in this process), ``disk`` (atomic files, SQLite key index),
  ``redis`` (shared), each opened through ``tiers/registry.py``.
* ``maintenance`` (verify, gc, usage), ``replication`` (copying blocks to the durable tiers
  that lack them), ``metrics``, ``cli`` (``cwm store``).

Submodules are imported explicitly (``from cwm_plugin.store.kv_store import KVStore``) so that
importing the package costs nothing.
"""
