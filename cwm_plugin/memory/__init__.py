"""File-first memory: markdown files are the truth; chunks, BM25 and vectors are derived.

Entry point: :class:`cwm_plugin.memory.service.service.MemoryService` (build one with
:func:`cwm_plugin.memory.service.factory.make_service`). One concern a module: ``names`` (safe folder and
session names), ``files`` (durable appends, memories, summaries), ``tokens`` (counters),
``chunking``, ``embeddings`` (+ cache), ``bm25`` (tokens, incremental BM25), ``index`` (one
folder's chunks: BM25 + line vectors in hnswlib), ``memindex`` (durable memories as a search
corpus), ``persist`` (an index on disk), ``folders`` (indexes kept in step with the files),
``search`` (hybrid scoring), ``history`` (prefix / history / recent window), ``select``
(budgeted context), ``facts`` (the extraction contract), ``metrics``, ``cli`` (``cwm memory``).
Nothing heavy is imported here.
"""
