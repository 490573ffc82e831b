"""KV block store: encoded blocks under opaque keys, over CPU memory, local disk and Redis.

* ``config.StoreConfig``: the settings (dict / YAML / ``CWM_STORE_*`` environment).
* ``blob/``: the blob format -- ``codec`` (tensor <-> self-describing, checksummed
  safetensors+zstd blob), ``container`` (its header, without torch), ``crypto`` (encryption
  at rest), ``address`` (content ids).
* ``kv_store.KVStore``: the store the connector and the windows engine use (its reads in
  ``read_path``, its batch key operations -- presence, delete, link, per-key pins -- in
  ``key_ops``, bounded saves in ``save_queue``).
* ``tiers/``: ``ram`` (LRU in this process), ``disk`` (atomic files, SQLite key index),
  ``redis`` (shared), each opened through ``tiers/registry.py``.
* ``tier_set`` (the tiers alone, for ``cwm store gc|usage``), ``maintenance`` (verify, gc,
  usage), ``metrics``, ``cli`` (``cwm store``).

Submodules are imported explicitly (``from cwm_plugin.store.kv_store import KVStore``) so that
importing the package costs nothing.
"""
