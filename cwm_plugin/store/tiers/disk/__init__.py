"""The disk tier: one file a blob, atomic writes, a SQLite key index."""
