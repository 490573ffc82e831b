"""Test and benchmark harness: offline model builders and real server processes (vLLM, Redis)."""
