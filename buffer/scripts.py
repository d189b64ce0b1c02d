"""The Lua scripts that make each buffer operation atomic, with payloads kept out of Lua.

Why scripts and not plain MULTI: an insert must *decide* (is this group id new? is there room?) and then
write, and only a script can branch server-side without a second round trip or a WATCH retry loop.
Why payloads stay out of them: every script argument is copied into a Lua string and again into the
command it calls, which made an EVALSHA carrying a 115 KB group cost about twice a raw XADD. So a put
is ``MULTI; SET payload:<nonce> <bytes> PX ttl; EVALSHA PUT; EXEC`` in one round trip: the payload lands
in its own key straight from the query buffer, and PUT (with only small arguments) either PERSISTs it
and appends a small header entry, or deletes it (a duplicate). When the stream is full the payload is
left, under its TTL, for the producer's next attempt, so a waiting producer does not resend it.
Each script touches the keys it is given plus payload keys it derives from them, which is valid on
Redis 6.2 and 7.x alike (this is not a cluster client). Entries are deleted as they are settled
(acknowledged, dropped, dead-lettered), so ``XLEN`` is the number of unacknowledged groups and a trim
can never remove one that was not acknowledged.
"""

from __future__ import annotations

import redis

# KEYS: stream, seen-marker, counters, payload key.
# ARGV: max_groups, max_bytes, marker_ttl_ms, tokens, group_id, oldest_version, codec, payload nonce,
#       completion lengths (buffer.lengths.encode_counts).
# Returns {1, id} inserted | {0, existing id} duplicate | {-1, depth, bytes} full (payload kept for
# the retry) | {-2} the payload key is gone (its TTL ran out while the producer waited): send it again.
PUT = """
local existing = redis.call('GET', KEYS[2])
if existing then
  redis.call('DEL', KEYS[4])
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  return {0, existing}
end
if redis.call('EXISTS', KEYS[4]) == 0 then return {-2} end
local n = redis.call('STRLEN', KEYS[4])
local depth = redis.call('XLEN', KEYS[1])
local bytes = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
-- A single group larger than the byte bound is still admitted into an empty stream; otherwise it
-- could never be inserted at all.
if depth >= tonumber(ARGV[1]) or (depth > 0 and bytes + n > tonumber(ARGV[2])) then
  return {-1, depth, bytes}
end
redis.call('PERSIST', KEYS[4])
local id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[5], 'v', ARGV[6], 'c', ARGV[7], 'n', n, 'k', ARGV[8],
  'l', ARGV[9])
redis.call('SET', KEYS[2], id, 'PX', ARGV[3])
redis.call('HINCRBY', KEYS[3], 'produced', 1)
redis.call('HINCRBY', KEYS[3], 'bytes', n)
redis.call('HINCRBY', KEYS[3], 'produced_bytes', n)
redis.call('HINCRBY', KEYS[3], 'tokens', ARGV[4])
return {1, id}
"""

# Settle entries a consumer group has read: acknowledge, delete (with their payload key), count;
# optionally copy to the dead-letter stream (payload included) with a reason, and add to the staleness
# histogram and the length book (buffer.lengths). One call settles a whole batch, whatever counters its
# entries go to.
# KEYS: stream, counters, staleness-hash, dead-letter stream, lengths-hash.
# ARGV: group, dead_letter_maxlen, consumer, consumed_delta ('consumed' counter), payload key prefix,
#       then per entry: id, counter ('' = none), nbytes ('' = look it and the nonce up in the entry),
#       lag ('' = not histogrammed), reason ('' = not dead-lettered), payload nonce ('' = none),
#       lengths ('key:n,...' added to the lengths hash as '<counter>:<key>'; '' = none).
# Only entries still pending are settled (XACK returned 1), so a repeated ack counts once.
# Returns {counter, settled, ...}.
SETTLE = """
local settled, freed, lags, acked, pkeys, lens = {}, 0, {}, {}, {}, {}
for i = 6, #ARGV, 7 do
  local id, counter, nbytes, lag = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local reason, nonce, lengths = ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
  local entry = nil
  if nbytes == '' or reason ~= '' then
    -- The caller did not read this entry itself (e.g. another reader object), or it is dead-lettered
    -- with all its fields: look it up.
    local found = redis.call('XRANGE', KEYS[1], id, id)
    if found[1] then entry = found[1][2] end
  end
  if nbytes == '' then
    nbytes = '0'
    if entry then
      for j = 1, #entry, 2 do
        if entry[j] == 'n' then nbytes = entry[j + 1] elseif entry[j] == 'k' then nonce = entry[j + 1] end
      end
    end
  end
  -- Per entry only the XACK (its reply says whether it was still pending); deletes and counters are
  -- gathered and sent once for the batch below.
  if redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
    local pkey = nil
    if nonce ~= '' then pkey = ARGV[5] .. nonce end
    if reason ~= '' then
      local fields = {'entry', id, 'stream', KEYS[1], 'reason', reason, 'consumer', ARGV[3]}
      if entry then
        for _, v in ipairs(entry) do fields[#fields + 1] = v end
      end
      if pkey then
        local payload = redis.call('GET', pkey)
        if payload then fields[#fields + 1] = 'd'; fields[#fields + 1] = payload end
      end
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[2], '*', unpack(fields))
    elseif lag ~= '' then
      lags[lag] = (lags[lag] or 0) + 1
    end
    if counter ~= '' then
      for key, n in string.gmatch(lengths, '(%w+):(%d+)') do
        local f = counter .. ':' .. key
        lens[f] = (lens[f] or 0) + tonumber(n)
      end
    end
    acked[#acked + 1] = id
    if pkey then pkeys[#pkeys + 1] = pkey end
    settled[counter] = (settled[counter] or 0) + 1
    freed = freed + (tonumber(nbytes) or 0)
  end
end
-- In slices: unpack() of a very long list would overflow Lua's C stack.
for s = 1, #acked, 1000 do redis.call('XDEL', KEYS[1], unpack(acked, s, math.min(s + 999, #acked))) end
for s = 1, #pkeys, 1000 do redis.call('DEL', unpack(pkeys, s, math.min(s + 999, #pkeys))) end
for lag, count in pairs(lags) do redis.call('HINCRBY', KEYS[3], lag, count) end
for f, count in pairs(lens) do redis.call('HINCRBY', KEYS[5], f, count) end
local out = {}
for counter, count in pairs(settled) do
  if counter ~= '' then redis.call('HINCRBY', KEYS[2], counter, count) end
  out[#out + 1] = counter
  out[#out + 1] = count
end
-- A hand-written entry can claim bytes no put ever added: never let the total go negative (that
-- would let producers overshoot the bound).
if freed > 0 and redis.call('HINCRBY', KEYS[2], 'bytes', -freed) < 0 then
  redis.call('HSET', KEYS[2], 'bytes', 0)
end
if ARGV[4] ~= '0' then redis.call('HINCRBY', KEYS[2], 'consumed', ARGV[4]) end
return out
"""

# KEYS: stream. ARGV: group, then entry ids read by this consumer and not trained (never handed out, or
# handed out and given back).
# Each one still pending is acknowledged, deleted and appended again with the same fields under a new id:
# undelivered, as if never read, for whichever reader comes next. Counters, bytes and the payload key are
# untouched (the group was neither consumed nor settled). Returns how many were released.
RELEASE = """
local released = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
    local found = redis.call('XRANGE', KEYS[1], id, id)
    if found[1] then
      redis.call('XDEL', KEYS[1], id)
      redis.call('XADD', KEYS[1], '*', unpack(found[1][2]))
      released = released + 1
    end
  end
end
return released
"""


class Scripts:
    """The scripts registered on one client (EVALSHA, reloaded transparently after a SCRIPT FLUSH)."""

    def __init__(self, client: redis.Redis) -> None:
        self.put = client.register_script(PUT)
        self.settle = client.register_script(SETTLE)
        self.release = client.register_script(RELEASE)


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) from the beginning, if it does not exist yet."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
