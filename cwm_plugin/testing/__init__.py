"""Test and benchmark harness: offline model builders, real server processes (vLLM, Redis,
``cwm serve``) and the project's generated conversations (``conversations/``)."""
