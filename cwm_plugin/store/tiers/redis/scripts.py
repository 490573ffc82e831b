"""Lua scripts of the Redis tier: each runs in one hash slot, atomically (names: ``redis_layout``).

*Blob scripts* (``KEYS``: the blob's value and its meta hash) keep a blob's reference and pin
counts with its bytes (written before, in one transaction: blob bytes never go through Lua):
``blob_ref`` adds reference and pin deltas (counting a blob just written) and, when no
reference is left, deletes the value and the meta in the same step, returning ``{refs (0
freed, -1 not held, -2 unknown), pins before, pins after, size, grp, the freed value's head}``;
``drop_parts`` then deletes a freed blob's parts unless it was written again meanwhile.

*Key scripts* (``KEYS``: the shard's index, its pins hash, then key names; ``ARGV``: the TTL
('' for none), the time, then per-key arguments) change the keys of one shard: ``set_keys``
(first writer wins unless replacing), ``delete_keys``, ``pin_keys``, ``unpin_keys``.

A reference or pin is counted on the blob *before* a key points to it or is pinned, and given
back *after* the key stopped; so a client that dies between two scripts leaves a count too
high (the blob kept until ``gc``, which goes by the keys themselves, or its TTL), never too
low (bytes deleted under a key). *Quota scripts* reserve a group's pinned bytes before pins.
"""

# ARGV: refs delta, pins delta, and to count a blob whose bytes were just written: its size,
# its group (hex), and (unused) whether this client created the bytes. Counts left from an
# evicted value of the same id are kept, not reset: another writer may have counted the new
# value between its SET NX and this script, and a reset lost that reference (the bytes were
# then freed under a live key); a stale count is too high, which gc corrects. A reference is
# only taken on a blob whose bytes are there.
BLOB_REF = """
local v, m = KEYS[1], KEYS[2]
local dr, dp = tonumber(ARGV[1]), tonumber(ARGV[2])
local there = redis.call('EXISTS', v) == 1
if there and ARGV[3] and ARGV[3] ~= '' then
  if redis.call('EXISTS', m) == 0 then
    redis.call('HSET', m, 'refs', 0, 'pins', 0, 'size', ARGV[3], 'grp', ARGV[4])
    local t = redis.call('PTTL', v)
    if t > 0 then redis.call('PEXPIRE', m, t) end
  end
end
if not there or redis.call('EXISTS', m) == 0 then
  if not there then redis.call('DEL', m) end
  if dr > 0 then return {-1, 0, 0, '0', '', ''} end
  return {-2, 0, 0, '0', '', ''}
end
local pins0 = tonumber(redis.call('HGET', m, 'pins') or '0')
local refs = redis.call('HINCRBY', m, 'refs', dr)
local pins = pins0
if dp ~= 0 then
  pins = math.max(0, pins0 + dp)
  redis.call('HSET', m, 'pins', pins)
end
local size, grp = redis.call('HGET', m, 'size') or '0', redis.call('HGET', m, 'grp') or ''
if refs <= 0 then
  local head = redis.call('GETRANGE', v, 0, 127)
  redis.call('DEL', v, m)
  return {0, pins0, 0, size, grp, head}
end
return {refs, pins0, pins, size, grp, ''}
"""

# KEYS: a freed blob's value, then its parts: deleted unless the value is back (written again,
# parts first, in one transaction, since the value was freed)
DROP_PARTS = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""

_KEYS = """
local INDEX, PINS, TTL, NOW = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
local out = {}
"""

# ARGV: ttl, now, then per key: key hex, blob, replace ('1': re-point a key that points
# elsewhere) -> per key {key hex, 1 same blob | 0 kept another | 2 set, old blob or '', pinned}
SET_KEYS = _KEYS + """
for i = 3, #KEYS do
  local k, r, b, replace = KEYS[i], ARGV[i * 3 - 6], ARGV[i * 3 - 5], ARGV[i * 3 - 4]
  local pinned = redis.call('HEXISTS', PINS, r)
  local old = redis.call('GET', k)
  if old == b then
    if TTL ~= '' and redis.call('TTL', k) >= 0 then redis.call('EXPIRE', k, TTL) end
    table.insert(out, {r, 1, b, pinned})
  elseif old and replace ~= '1' then
    table.insert(out, {r, 0, old, pinned})
  else
    if old then redis.call('SET', k, b, 'KEEPTTL')
    elseif TTL ~= '' and pinned == 0 then redis.call('SET', k, b, 'EX', TTL)
    else redis.call('SET', k, b) end
    redis.call('ZADD', INDEX, 0, r)
    table.insert(out, {r, 2, old or '', pinned})
  end
end
return out
"""

# ARGV: ttl, now, then per key: key hex, expected blob ('' = any)
# -> per key deleted {key hex, blob, pinned 0/1}
DELETE_KEYS = _KEYS + """
for i = 3, #KEYS do
  local k, r, want = KEYS[i], ARGV[i * 2 - 3], ARGV[i * 2 - 2]
  local b = redis.call('GET', k)
  if not b then redis.call('ZREM', INDEX, r) end
  if b and (want == '' or want == b) then
    local pinned = redis.call('HDEL', PINS, r)
    redis.call('DEL', k)
    redis.call('ZREM', INDEX, r)
    table.insert(out, {r, b, pinned})
  end
end
return out
"""

# ARGV: ttl, now, expires (0 = never), then key hexes -> per key pinned {key hex, blob, was 0/1}
PIN_KEYS = _KEYS + """
for i = 3, #KEYS do
  local k, r = KEYS[i], ARGV[i + 1]
  local b = redis.call('GET', k)
  if b then
    local was = redis.call('HEXISTS', PINS, r)
    redis.call('HSET', PINS, r, ARGV[3])
    redis.call('PERSIST', k)
    table.insert(out, {r, b, was})
  end
end
return out
"""

# ARGV: ttl, now, only expired ('1': only pins whose expiry passed), then key hexes
# -> per key unpinned {key hex, blob or ''}
UNPIN_KEYS = _KEYS + """
for i = 3, #KEYS do
  local k, r = KEYS[i], ARGV[i + 1]
  local e = tonumber(redis.call('HGET', PINS, r) or '-1')
  if e >= 0 and (ARGV[3] ~= '1' or (e > 0 and e <= NOW)) then
    redis.call('HDEL', PINS, r)
    local b = redis.call('GET', k)
    if b and TTL ~= '' then redis.call('EXPIRE', k, TTL) end
    table.insert(out, {r, b or ''})
  end
end
return out
"""

# KEYS: a group's pinbytes; ARGV: bytes to add, quota ('' = none) -> {1, total} or {-1, total}
RESERVE = """
local total = tonumber(redis.call('GET', KEYS[1]) or '0') + tonumber(ARGV[1])
if ARGV[2] ~= '' and tonumber(ARGV[1]) > 0 and total > tonumber(ARGV[2]) then
  return {-1, total}
end
redis.call('INCRBY', KEYS[1], ARGV[1])
return {1, total}
"""

# KEYS: a group's pinexp; ARGV: now, key hexes -> drops those whose expiry is still past
UNEXPIRE = """
for i = 2, #ARGV do
  local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if s and tonumber(s) <= tonumber(ARGV[1]) then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return 1
"""

SCRIPTS = {"blob_ref": BLOB_REF, "drop_parts": DROP_PARTS, "set_keys": SET_KEYS,
           "delete_keys": DELETE_KEYS, "pin_keys": PIN_KEYS, "unpin_keys": UNPIN_KEYS,
           "reserve": RESERVE, "unexpire": UNEXPIRE}
