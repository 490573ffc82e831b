"""Context windows on real KV: freeze a session's context under a name, thaw it into any
session later (after a restart, on another server sharing Redis), clone it into branches,
list, inspect and delete -- by re-keying and pinning the stored blocks, never by replaying text.

* ``model``: the manifest, names, keys; ``hashing``: vLLM's block hashing outside vLLM;
* ``engine``: :class:`~cwm_plugin.windows.engine.WindowEngine`, the operations (no HTTP);
  ``opening``: the engine as the sidecar's ``windows:`` settings describe it;
* ``cli``: ``cwm window ...``; the REST routes live in the sidecar, the MCP tools in
  :mod:`cwm_plugin.mcp`.
"""
