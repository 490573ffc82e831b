"""A folder's memory as one service: turns, summaries, facts, transcripts, imports."""
