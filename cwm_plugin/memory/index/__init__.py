"""The memory's derived indexes over its files: chunks, BM25, vectors, hybrid search."""
