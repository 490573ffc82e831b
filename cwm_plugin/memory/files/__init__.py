"""The memory's markdown files, the truth: sessions, summaries, memories, pending turns."""
