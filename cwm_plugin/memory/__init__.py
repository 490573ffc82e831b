"""File-first memory: markdown files are the truth; chunks, BM25 and vectors are derived.

Entry point: :class:`~cwm_plugin.memory.service.service.MemoryService` (build one with
:func:`~cwm_plugin.memory.service.factory.make_service`, or from the settings file's ``memory``
section, ``settings.py``, with ``service_from_settings``). Its rooms, data flowing one way:

* ``files/``: the truth -- sessions, summaries and memories in markdown (``markdown.py``),
  durable appends and locks, pending turns, safe names, damage checks;
* ``index/``: derived from the files -- chunking, embeddings (+ cache), BM25, one folder's
  chunks and line vectors (``chunks.py``), durable memories as a corpus (``fact_index.py``),
  an index on disk (``persist.py``), indexes kept in step with the files (``folders.py``),
  hybrid scoring (``search.py``);
* ``selection/``: what a prompt carries -- ranked lines (``lines.py``), packed passages, dates,
  the prefix / history / recent split of a request's messages (``history.py``), the budgeted
  selection (``select.py``);
* ``service/``: the service, its transcripts and background jobs, facts (the extraction
  contract and the store of durable memories, ``facts_file.py``), bulk imports, the factory;

beside them ``models``, ``tokens`` (counters), ``metrics``, ``settings`` and ``cli``
(``cwm memory``). Nothing heavy is imported here.
"""
