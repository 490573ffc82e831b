"""Lua scripts of the Redis tier: each keeps one multi-key change atomic (see ``redis.py`` for
the key layout). Dynamic names (``<prefix>r:<old blob>``) are built inside the scripts, so
they suit a single Redis, not Redis Cluster.
"""

# Renew the TTL of names that have one (TTL >= 0); a pinned, PERSISTed name keeps none.
_TOUCH_FN = """
local function touch(name, ttl)
  if ttl ~= '' and redis.call('TTL', name) >= 0 then redis.call('EXPIRE', name, ttl) end
end
"""
# KEYS: b, stats, [k, r, pins]; ARGV: value, ttl, blob id, size, [replace]
# A blob that is already there is kept and its TTL renewed: a new key mapped onto it must not
# outlive it (shared content: the same prefix under another salt).
_PUT = _TOUCH_FN + """
local ttl = ARGV[2]
local created = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ttl ~= '' then redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
  else redis.call('SET', KEYS[1], ARGV[1]) end
  redis.call('HINCRBY', KEYS[2], 'bytes', ARGV[4])
  redis.call('HINCRBY', KEYS[2], 'blobs', 1)
  created = 1
else
  touch(KEYS[1], ttl)
end
local mapped = 0
if #KEYS >= 5 then
  if redis.call('EXISTS', KEYS[3]) == 0 then
    if ttl ~= '' then redis.call('SET', KEYS[3], ARGV[3], 'EX', ttl)
    else redis.call('SET', KEYS[3], ARGV[3]) end
    redis.call('INCR', KEYS[4])
    if ttl ~= '' and redis.call('EXISTS', KEYS[5]) == 0 then redis.call('EXPIRE', KEYS[4], ttl) end
    mapped = 1
  else
    touch(KEYS[3], ttl)
    touch(KEYS[4], ttl)
  end
end
return {created, mapped, redis.call('HGET', KEYS[2], 'bytes'), redis.call('HGET', KEYS[2], 'blobs')}
"""
# KEYS: the parts of a split blob; ARGV: ttl. Renews the TTL of those that have one.
_TOUCH = _TOUCH_FN + """
for i = 1, #KEYS do touch(KEYS[i], ARGV[1]) end
return 0
"""
# KEYS: k, b, r, pins; ARGV: blob id, ttl, prefix, key hex, replace
# -> {status, previous blob or '', refs left to it, pin moved}; status 1 mapped, 0 the key
# points elsewhere (replace off), -1 the blob is gone
_MAP = """
local old = redis.call('GET', KEYS[1])
if old == ARGV[1] then return {1, '', 0, 0} end
if old and ARGV[5] ~= '1' then return {0, '', 0, 0} end
if redis.call('EXISTS', KEYS[2]) == 0 then return {-1, '', 0, 0} end
local left, moved = 0, 0
if old then
  local r = ARGV[3] .. 'r:' .. old
  if redis.call('EXISTS', r) == 1 then
    left = redis.call('DECR', r)
    if left <= 0 then redis.call('DEL', r) end
  end
  if redis.call('SREM', ARGV[3] .. 'pins:' .. old, ARGV[4]) == 1 then
    redis.call('SADD', KEYS[4], ARGV[4])
    moved = 1
  end
  redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
elseif ARGV[2] ~= '' then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
else redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('INCR', KEYS[3])
if ARGV[2] ~= '' and redis.call('EXISTS', KEYS[4]) == 0 then redis.call('EXPIRE', KEYS[3], ARGV[2]) end
return {1, old or '', left, moved}
"""
# KEYS: k; ARGV: prefix, key hex -> {blob, refs left, was pinned} or nil
_UNMAP = """
local b = redis.call('GET', KEYS[1])
if not b then return false end
redis.call('DEL', KEYS[1])
local unpinned = redis.call('SREM', ARGV[1] .. 'pins:' .. b, ARGV[2])
local r = ARGV[1] .. 'r:' .. b
local n = 0
if redis.call('EXISTS', r) == 1 then
  n = redis.call('DECR', r)
  if n <= 0 then redis.call('DEL', r) end
end
return {b, n, unpinned}
"""
# KEYS: b, r, pins, legacy pin, stats, parts...; ARGV: size
# -> {1 if the blob existed, total bytes, total blobs}
_DELETE = """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('DEL', unpack(KEYS, 1, 4))
if existed == 1 then
  for i = 6, #KEYS do redis.call('DEL', KEYS[i]) end
  redis.call('HINCRBY', KEYS[5], 'bytes', -tonumber(ARGV[1]))
  redis.call('HINCRBY', KEYS[5], 'blobs', -1)
end
return {existed, redis.call('HGET', KEYS[5], 'bytes'), redis.call('HGET', KEYS[5], 'blobs')}
"""
# KEYS: pins, k, b, r, parts...; ARGV: key hex, '1' pin / '' unpin, ttl
_PIN = """
if ARGV[2] == '1' then
  redis.call('SADD', KEYS[1], ARGV[1])
  for i = 2, #KEYS do redis.call('PERSIST', KEYS[i]) end
  return 1
end
redis.call('SREM', KEYS[1], ARGV[1])
if ARGV[3] ~= '' then
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  if redis.call('SCARD', KEYS[1]) == 0 then
    for i = 3, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
  end
end
return 0
"""


SCRIPTS = {"put": _PUT, "touch": _TOUCH, "map": _MAP, "unmap": _UNMAP, "delete": _DELETE,
           "pin": _PIN}
