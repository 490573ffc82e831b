"""The vLLM servers behind the sidecar: one client each (``client.py``, ``endpoints.py``),
routing by model and role with health checks and failover (``router.py``, ``routing.py``),
and relaying streamed answers (``stream.py``)."""
