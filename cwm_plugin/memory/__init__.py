"""File-first memory: markdown files are the truth; chunks, BM25 and vectors are derived.

Entry point: :class:`cwm_plugin.memory.service.MemoryService` (build one with
:func:`cwm_plugin.memory.factory.make_service`). One concern a module: ``names`` (safe tenant and
session names), ``files`` (durable appends, memories, summaries), ``tokens`` (counters),
``chunking``, ``embeddings`` (+ cache), ``index`` (one tenant's BM25 + hnswlib), ``search``
(hybrid scoring), ``select`` (budgeted context), ``facts`` (the extraction contract),
``metrics``, ``cli`` (``cwm memory``). Nothing heavy is imported here.
"""
