"""The Lua scripts that make each buffer operation one atomic round trip.

Why scripts and not MULTI: an insert must *decide* (is this group id new? is there room?) and then
write, and only a script can branch server-side without a second round trip or a WATCH retry loop.
Each script touches only the keys it is given, so it stays valid on Redis 6.2 and 7.x alike.
Entries are deleted as they are settled (acknowledged, dropped, dead-lettered), so ``XLEN`` is the
number of unacknowledged groups and a trim can never remove one that was not acknowledged.
"""

from __future__ import annotations

import redis

# KEYS: stream, seen-marker, counters.
# ARGV: max_groups, max_bytes, marker_ttl_ms, tokens, group_id, oldest_version, codec, payload.
# Returns {1, id} inserted | {0, existing id} duplicate | {-1, depth, bytes} full.
PUT = """
local existing = redis.call('GET', KEYS[2])
if existing then
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  return {0, existing}
end
local n = string.len(ARGV[8])
local depth = redis.call('XLEN', KEYS[1])
local bytes = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
-- A single group larger than the byte bound is still admitted into an empty stream; otherwise it
-- could never be inserted at all.
if depth >= tonumber(ARGV[1]) or (depth > 0 and bytes + n > tonumber(ARGV[2])) then
  return {-1, depth, bytes}
end
local id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[5], 'v', ARGV[6], 'c', ARGV[7], 'n', n, 'd', ARGV[8])
redis.call('SET', KEYS[2], id, 'PX', ARGV[3])
redis.call('HINCRBY', KEYS[3], 'produced', 1)
redis.call('HINCRBY', KEYS[3], 'bytes', n)
redis.call('HINCRBY', KEYS[3], 'produced_bytes', n)
redis.call('HINCRBY', KEYS[3], 'tokens', ARGV[4])
return {1, id}
"""

# Settle entries a consumer group has read: acknowledge, delete, count; optionally copy to the
# dead-letter stream with a reason, and add to the staleness histogram.
# KEYS: stream, counters, staleness-hash, dead-letter stream.
# ARGV: group, counter ('' = none), dead_letter_maxlen, consumer, consumed_delta ('consumed' counter),
#       then per entry: id, nbytes ('' = look it up), lag ('' = not histogrammed), reason ('' = not dead-lettered).
# Only entries still pending are settled (XACK returned 1), so a repeated ack counts once.
SETTLE = """
local settled, freed = 0, 0
for i = 6, #ARGV, 4 do
  local id, reason = ARGV[i], ARGV[i + 3]
  if ARGV[i + 1] == '' then
    -- The caller did not read this entry itself (e.g. another reader object): look its size up.
    ARGV[i + 1] = '0'
    local found = redis.call('XRANGE', KEYS[1], id, id)
    if found[1] then
      local f = found[1][2]
      for j = 1, #f, 2 do if f[j] == 'n' then ARGV[i + 1] = f[j + 1] end end
    end
  end
  if reason ~= '' then
    local fields = {'entry', id, 'stream', KEYS[1], 'reason', reason, 'consumer', ARGV[4]}
    local found = redis.call('XRANGE', KEYS[1], id, id)
    if found[1] then
      for _, v in ipairs(found[1][2]) do fields[#fields + 1] = v end
    end
    if redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', unpack(fields))
      redis.call('XDEL', KEYS[1], id)
      settled = settled + 1
      freed = freed + (tonumber(ARGV[i + 1]) or 0)
    end
  elseif redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
    redis.call('XDEL', KEYS[1], id)
    settled = settled + 1
    freed = freed + (tonumber(ARGV[i + 1]) or 0)
    if ARGV[i + 2] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[i + 2], 1) end
  end
end
if settled > 0 then
  if ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[2], settled) end
  -- A hand-written entry can claim bytes no put ever added: never let the total go negative (that
  -- would let producers overshoot the bound).
  if freed > 0 and redis.call('HINCRBY', KEYS[2], 'bytes', -freed) < 0 then
    redis.call('HSET', KEYS[2], 'bytes', 0)
  end
end
if ARGV[5] ~= '0' then redis.call('HINCRBY', KEYS[2], 'consumed', ARGV[5]) end
return settled
"""


class Scripts:
    """The scripts registered on one client (EVALSHA, reloaded transparently after a SCRIPT FLUSH)."""

    def __init__(self, client: redis.Redis) -> None:
        self.put = client.register_script(PUT)
        self.settle = client.register_script(SETTLE)


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) from the beginning, if it does not exist yet."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
