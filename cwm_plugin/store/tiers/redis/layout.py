"""Names of the Redis tier (format 3): which cluster slot each piece of state lives in.

Under ``<prefix>:``, with the hash tag in braces deciding the slot:

* ``{k<s>}:k:<key hex>`` -> blob id (string, with the TTL; none while pinned). ``s`` is the key's
  *shard*, a checksum of the whole key modulo :data:`SHARDS` (a model's blocks spread over
  every shard, and so over every master); ``{k<s>}:i`` (sorted set of the shard's key hexes,
  for ordered listing) and ``{k<s>}:p`` (hash: key hex -> pin expiry, 0 = never) sit in the
  same slot, so a batch's keys of one shard change in one script.
* ``{b:<blob id>}`` -> the blob or a manifest of its parts ``{b:<blob id>}:<i>``, and
  ``{b:<blob id>}:m`` (hash: ``refs``, ``pins``, ``size``, ``grp``): the blob's reference and
  pin counts in its own slot, with its bytes' TTL, so they expire together.
* ``{q<group hex>}:pinbytes`` and ``{q<group hex>}:pinexp``: a key group's pinned bytes (the
  pin quota's counter) and its pins' expiries; only pinning touches them.
* ``{s<i>}:stats``: approximate totals in :data:`STATS_SHARDS` hashes, summed on read.

Format 2 named everything of one namespace and rank ``{<group hex>}:...`` (one slot for a
model's whole index) and kept one ``stats`` hash. Nothing reads those names (their blocks are
recomputed); :func:`old_format` recognises them for ``gc`` to delete.
"""

from __future__ import annotations

import zlib

SHARDS = 256            # key shards (on 3 masters with even slot ranges: 89/82/85 tags)
STATS_SHARDS = 16       # (5/5/6)
GROUP_HEX = 36          # 18-byte key groups (namespace + rank), as format 2 tagged them


def shard_of(key: bytes) -> int:
    return zlib.crc32(key) % SHARDS


class Names:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def _shard(self, shard: int) -> str:
        return f"{self.prefix}:{{k{shard:02x}}}"

    def key(self, key: bytes) -> str:
        return f"{self._shard(shard_of(key))}:k:{bytes(key).hex()}"

    def index(self, shard: int) -> str:
        return f"{self._shard(shard)}:i"

    def pins(self, shard: int) -> str:
        return f"{self._shard(shard)}:p"

    def pinbytes(self, group_hex: str) -> str:
        return f"{self.prefix}:{{q{group_hex}}}:pinbytes"

    def pinexp(self, group_hex: str) -> str:
        return f"{self.prefix}:{{q{group_hex}}}:pinexp"

    def stats(self, i: int) -> str:
        return f"{self.prefix}:{{s{i:x}}}:stats"

    def stats_of(self, blob_id: str) -> str:
        return self.stats(int(blob_id[:8], 16) % STATS_SHARDS)

    @property
    def key_pattern(self) -> str:
        return f"{self.prefix}:{{k*}}:k:*"

    @property
    def pinbytes_pattern(self) -> str:
        return f"{self.prefix}:{{q*}}:pinbytes"

    def parse_key(self, name: str) -> bytes | None:
        """The key a key name holds; None for a name of another form."""
        head, sep, rest = name.rpartition("}:k:")
        if not sep or not head.startswith(f"{self.prefix}:{{k"):
            return None
        try:
            return bytes.fromhex(rest)
        except ValueError:
            return None

    def old_format(self, name: str) -> bool:
        """A format-2 name: ``stats``, or anything tagged with a key group's hex."""
        if name == f"{self.prefix}:stats":
            return True
        start = len(self.prefix) + 2
        tag = name[start:name.find("}", start)] if name.startswith(f"{self.prefix}:{{") else ""
        return len(tag) == GROUP_HEX and all(c in "0123456789abcdef" for c in tag)
