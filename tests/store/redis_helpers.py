"""Keys and blob ids of the Redis tests: one key group, names readable in a failure."""

from __future__ import annotations

G = b"R" * 16 + b"\x00\x00"     # a key group (namespace digest and rank)


def k(name: bytes) -> bytes:
    """The key ``name`` in group :data:`G`."""
    return G + name


def bid(c: str) -> str:
    """A blob id of 40 ``c``."""
    return c * 40
