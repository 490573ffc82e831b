"""cwm_plugin: context windows for LLM serving on vLLM.

Packages, one concern each, data flowing one way:
``store`` (codec + tiers) <- ``connector`` (vLLM KV connector), and later ``windows`` (freeze/thaw);
``memory`` (files, chunks, search) <- ``sidecar`` (OpenAI-compatible proxy).
"""

__version__ = "0.1.0"
