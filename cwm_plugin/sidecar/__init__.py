"""The OpenAI-compatible sidecar (``cwm serve``) in front of vLLM: per-tenant salts, memory,
windows, usage and limits. The app (``app.py``) over its routes (``api/``), over a turn's parts
(``turn/``, ``background/``), the upstreams (``upstream/``), identity and its settings
(``identity/``, ``settings/``); pyproject's ``[tool.importlinter]`` holds it to that order."""
