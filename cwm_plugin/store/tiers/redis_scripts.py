"""Lua scripts of the Redis tier's key index: one script a batch operation, one hash slot.

Every script works inside one key *group* (namespace + rank), whose names share the hash tag
``{<group hex>}`` and so one slot of a Redis Cluster (see ``redis.py`` for the layout). The
common ``KEYS`` are ``refs, sizes, pins, pinned, pinbytes, pinexp, index`` followed by the key
names ``k:<rest>`` (``index`` is a sorted set of the group's rests, for ordered listing); ``ARGV`` starts with the TTL ('' for none) and the current time. A script checks
everything before it writes, so an error (a quota) leaves nothing half-done; Redis runs it
atomically. Blob bytes live in their own slots and are written before, and deleted after, the
script that references or frees them (a crash between leaves an orphan that ``gc`` removes,
never a key pointing to bytes that were not written).

Returned blob lists tell the client what to do with blob bytes: ``freed`` (no key left: delete
the bytes), ``protect`` (first pinned key: PERSIST the bytes), ``release`` (last pin gone:
give the bytes their TTL back).
"""

_COMMON = """
local REFS, SIZES, PINS, PINNED, PINBYTES, PINEXP = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local INDEX = KEYS[7]
local TTL, NOW = ARGV[1], tonumber(ARGV[2])
local function size_of(b) return tonumber(redis.call('HGET', SIZES, b) or '0') end
local function pin_ref(b, delta, protect, release)
  local n = redis.call('HINCRBY', PINNED, b, delta)
  if delta > 0 and n == 1 then
    redis.call('INCRBY', PINBYTES, size_of(b)); table.insert(protect, b)
  elseif delta < 0 and n <= 0 then
    redis.call('HDEL', PINNED, b); redis.call('DECRBY', PINBYTES, size_of(b))
    table.insert(release, b)
  end
end
local function unref(b, freed)
  local n = redis.call('HINCRBY', REFS, b, -1)
  if n <= 0 then
    redis.call('HDEL', REFS, b); redis.call('HDEL', SIZES, b); redis.call('HDEL', PINNED, b)
    table.insert(freed, b)
  end
end
-- drop the pin of key name k (rest r) pointing to blob b
local function unpin_key(k, r, b, protect, release)
  if redis.call('HDEL', PINS, r) == 1 then
    redis.call('ZREM', PINEXP, r)
    if b then
      pin_ref(b, -1, protect, release)
      if TTL ~= '' then redis.call('EXPIRE', k, TTL) end
    end
    return true
  end
  return false
end
-- pins whose expiry passed (their key names are rebuilt from the k: prefix)
local function expire_pins(kprefix, protect, release)
  for _, r in ipairs(redis.call('ZRANGEBYSCORE', PINEXP, '-inf', NOW)) do
    local k = kprefix .. r
    unpin_key(k, r, redis.call('GET', k), protect, release)
  end
end
"""

# ARGV: ttl, now, kprefix, blob, size, replace ('1': re-point a key that points elsewhere)
# KEYS[8]: k -> {1 mapped | 0 the key kept another blob, freed, protect, release}
MAP = _COMMON + """
local k, b = KEYS[8], ARGV[4]
local old = redis.call('GET', k)
if old == b then
  if TTL ~= '' and redis.call('TTL', k) >= 0 then redis.call('EXPIRE', k, TTL) end
  return {1, {}, {}, {}}
end
if old and ARGV[6] ~= '1' then return {0, {}, {}, {}} end
local protect, release, freed = {}, {}, {}
redis.call('HSET', SIZES, b, ARGV[5])
redis.call('HINCRBY', REFS, b, 1)
if old then
  local r = string.sub(k, #ARGV[3] + 1)
  if redis.call('HEXISTS', PINS, r) == 1 then
    pin_ref(b, 1, protect, release)
    pin_ref(old, -1, protect, release)
  end
  unref(old, freed)
  redis.call('SET', k, b, 'KEEPTTL')
elseif TTL ~= '' then redis.call('SET', k, b, 'EX', TTL)
else redis.call('SET', k, b) end
redis.call('ZADD', INDEX, 0, string.sub(k, #ARGV[3] + 1))
return {1, freed, protect, release}
"""

# ARGV: ttl, now, kprefix, then pairs (rest, blob); KEYS[8..]: k names in pair order
# -> {linked rests, freed, protect, release}
LINK_MANY = _COMMON + """
local linked, freed, protect, release = {}, {}, {}, {}
for i = 8, #KEYS do
  local k = KEYS[i]
  local r, b = ARGV[4 + (i - 8) * 2], ARGV[5 + (i - 8) * 2]
  if redis.call('HEXISTS', SIZES, b) == 1 then
    local old = redis.call('GET', k)
    if old ~= b then
      local pinned = redis.call('HEXISTS', PINS, r) == 1
      redis.call('HINCRBY', REFS, b, 1)
      if pinned then pin_ref(b, 1, protect, release) end
      if old then
        if pinned then pin_ref(old, -1, protect, release) end
        unref(old, freed)
        redis.call('SET', k, b, 'KEEPTTL')
      elseif TTL ~= '' and not pinned then redis.call('SET', k, b, 'EX', TTL)
      else redis.call('SET', k, b) end
      redis.call('ZADD', INDEX, 0, r)
    end
    table.insert(linked, r)
  end
end
return {linked, freed, protect, release}
"""

# ARGV: ttl, now, kprefix, then per key: rest, expected blob ('' = any)
# -> {deleted rests, freed, protect, release}
DELETE_MANY = _COMMON + """
local found, freed, protect, release = {}, {}, {}, {}
for i = 8, #KEYS do
  local k = KEYS[i]
  local r, want = ARGV[4 + (i - 8) * 2], ARGV[5 + (i - 8) * 2]
  local b = redis.call('GET', k)
  if not b then redis.call('ZREM', INDEX, r) end
  if b and (want == '' or want == b) then
    unpin_key(k, r, b, protect, release)
    redis.call('DEL', k)
    redis.call('ZREM', INDEX, r)
    unref(b, freed)
    table.insert(found, r)
  end
end
return {found, freed, protect, release}
"""

# ARGV: ttl, now, kprefix, expires (0 = never), quota ('' = none), then rests
# -> {pinned rests, protect, release} or {-1, pinned bytes it would take}
PIN_MANY = _COMMON + """
local protect, release = {}, {}
expire_pins(ARGV[3], protect, release)
local expires, quota = tonumber(ARGV[4]), ARGV[5]
local blobs, add, seen = {}, 0, {}
for i = 8, #KEYS do
  local b = redis.call('GET', KEYS[i])
  blobs[i] = b
  if b and not seen[b] and redis.call('HEXISTS', PINS, ARGV[i - 2]) == 0
      and tonumber(redis.call('HGET', PINNED, b) or '0') == 0 then
    seen[b] = true
    add = add + size_of(b)
  end
end
local now_bytes = tonumber(redis.call('GET', PINBYTES) or '0')
if quota ~= '' and add > 0 and now_bytes + add > tonumber(quota) then
  return {-1, now_bytes + add}
end
local pinned = {}
for i = 8, #KEYS do
  local k, r, b = KEYS[i], ARGV[i - 2], blobs[i]
  if b then
    if redis.call('HEXISTS', PINS, r) == 0 then pin_ref(b, 1, protect, release) end
    redis.call('HSET', PINS, r, expires)
    if expires > 0 then redis.call('ZADD', PINEXP, expires, r)
    else redis.call('ZREM', PINEXP, r) end
    redis.call('PERSIST', k)
    table.insert(pinned, r)
  end
end
return {pinned, protect, release}
"""

# ARGV: ttl, now, kprefix, then rests -> {unpinned rests, protect, release}
UNPIN_MANY = _COMMON + """
local protect, release, done = {}, {}, {}
expire_pins(ARGV[3], protect, release)
for i = 8, #KEYS do
  local k, r = KEYS[i], ARGV[i - 4]
  if unpin_key(k, r, redis.call('GET', k), protect, release) then table.insert(done, r) end
end
return {done, protect, release}
"""

SCRIPTS = {"map": MAP, "link_many": LINK_MANY, "delete_many": DELETE_MANY,
           "pin_many": PIN_MANY, "unpin_many": UNPIN_MANY}
