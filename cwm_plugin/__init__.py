"""cwm_plugin: context windows for LLM serving on vLLM.

Packages, one concern each, each importing only those below it (pyproject's
``[tool.importlinter]`` checks it): ``store`` (blob format + tiers) <- ``connector`` (vLLM KV
connector) <- ``windows`` (freeze/thaw); ``memory`` (files, index, selection, service) and
``activity`` (the log) beside ``windows``; all of them <- ``sidecar`` (OpenAI-compatible
proxy) <- ``mcp``, ``testing``, ``cli``. Below them all the ground modules (``errors``,
``typed_config``, ``config_file``, ``compute_dtype``, ``timing``, ``salts``) and
``cwm_kernels``.
"""

__version__ = "0.1.0"
