"""KV block store: encoded blocks under opaque keys, over CPU memory, local disk and Redis.

* ``config.StoreConfig``: the settings (dict / YAML / ``CWM_STORE_*`` environment).
* ``codec``: tensor <-> self-describing, checksummed safetensors+zstd blob.
* ``tiered.KVStore``: the store the connector and the windows engine use (its write path in
  ``writes``, its key operations -- presence, delete, link, per-key pins -- in ``keyops``).
* ``tiers/``: memory (LRU), disk (atomic files), redis (shared); ``index``: SQLite catalog.
* ``metrics``, ``maintenance`` (verify, gc), ``queue`` (bounded saves), ``cli`` (``cwm store``).

Submodules are imported explicitly (``from cwm_plugin.store.kv_store import KVStore``) so that
importing the package costs nothing.
"""
