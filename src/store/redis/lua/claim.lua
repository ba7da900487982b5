-- Claims a record, or says what is there. KEYS[1] record; with quotas also KEYS[2] the
-- scope group's records (a sorted set: scope hex .. record id hex, by expiry ms) and KEYS[3]
-- its counts (a hash: each record id hex to its size, 'n' .. scope its records, 't' .. scope
-- its bytes).
-- All three share the record's hash tag: a group is every scope whose id starts with the same
-- 4 bytes, and each scope is still counted on its own.
-- ARGV[1] the new record's first 66 bytes: format, 'p', fingerprint, nonce, generation 1 (see
-- record.rs), ARGV[2] lease ms, ARGV[3] ms to keep a new record (max(ttl, lease)); with
-- quotas ARGV[4] the scope id in hex ('' for an uncounted record), ARGV[5] most records,
-- ARGV[6] most bytes (0: no limit), ARGV[7] the record id in hex.
--
-- Replies: n > 0 claimed with generation n (new, or this nonce's own claim sent again);
-- {n, lapsed ms} taken over at generation n; 0 someone else's record, not in progress;
-- -1 - ms someone else's record in progress, with ms of lease left; the status QUOTA when
-- the scope is full. The record itself comes from the GET pipelined after this script, so its
-- answer never passes through Lua.
--
-- Without quotas, on Redis 7 and later, the store claims with a plain SET … NX GET instead, and
-- sends this script only to take over, and when that SET is refused (a full Redis).
--
-- The lease field (bytes 67-82) is 'k' and 15 digits, the ms by which the lease ends before the
-- key expires (lease left = PTTL - gap: record.rs), or, from earlier versions and for a gap
-- past 15 digits, 16 digits of deadline by TIME. Both are read; a new one is written as a gap.
--
-- Reads before it writes: a full Redis refuses a script's first write, not the script, so an
-- existing record still comes back. TIME only where a lease matters. No helper functions:
-- defining them costs on every call.
local key, new = KEYS[1], ARGV[1]
local h = redis.call('GETRANGE', key, 0, 81)
if h == '' then
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  local gap, value = ARGV[3] - ARGV[2], nil
  if gap <= 999999999999999 then
    value = new .. string.format('k%015.0f', gap)
  else
    value = new .. string.format('%016.0f', now + ARGV[2])
  end
  if #KEYS == 1 or ARGV[4] == '' then
    redis.call('SET', key, value, 'PX', ARGV[3])
    return 1
  end
  local z, b, scope = KEYS[2], KEYS[3], ARGV[4]
  local most, budget = tonumber(ARGV[5]), tonumber(ARGV[6])
  value = value .. scope
  -- Forget the group's expired records (a bounded batch per claim), scope by scope. The
  -- counts go first: they are the writes a full Redis refuses, and then nothing has changed.
  local gone = redis.call('ZRANGEBYSCORE', z, '-inf', string.format('%.0f', now), 'LIMIT', 0, 500)
  if #gone > 0 then
    local ids = {}
    for i = 1, #gone do ids[i] = string.sub(gone[i], 65) end
    local sizes = redis.call('HMGET', b, unpack(ids))
    local n, bytes = {}, {}
    for i = 1, #gone do
      local s = string.sub(gone[i], 1, 64)
      n[s] = (n[s] or 0) + 1
      bytes[s] = (bytes[s] or 0) + (tonumber(sizes[i]) or 0)
    end
    for s, c in pairs(n) do
      redis.call('HINCRBY', b, 'n' .. s, -c)
      redis.call('HINCRBY', b, 't' .. s, -bytes[s])
    end
    redis.call('HDEL', b, unpack(ids))
    redis.call('ZREM', z, unpack(gone))
  end
  local counts = redis.call('HMGET', b, 'n' .. scope, 't' .. scope)
  if most > 0 and (tonumber(counts[1]) or 0) >= most then return {ok = 'QUOTA'} end
  if budget > 0 and (tonumber(counts[2]) or 0) + #value > budget then
    return {ok = 'QUOTA'}
  end
  redis.call('SET', key, value, 'PX', ARGV[3])
  local member, keep = scope .. ARGV[7], tonumber(ARGV[3])
  redis.call('ZADD', z, string.format('%.0f', now + keep), member)
  redis.call('HSET', b, ARGV[7], #value)
  redis.call('HINCRBY', b, 'n' .. scope, 1)
  redis.call('HINCRBY', b, 't' .. scope, #value)
  if redis.call('PTTL', z) < keep then redis.call('PEXPIRE', z, ARGV[3]) end
  if redis.call('PTTL', b) < keep then redis.call('PEXPIRE', b, ARGV[3]) end
  return 1
end
local head = string.sub(h, 1, 2)
-- 'p' in progress, 'r' in progress with a recovery point after the header (save.lua), which
-- a takeover keeps: the new holder reads it from the GET.
local state = string.sub(head, 2, 2)
if state ~= 'p' and state ~= 'r' then return 0 end
local gen = tonumber(string.sub(h, 51, 66))
-- Our own claim, sent again after a lost reply: fingerprint and nonce both match (equal
-- nonces alone never prove it is the same request).
if string.sub(h, 3, 50) == string.sub(new, 3, 50) then return gen end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local pttl = redis.call('PTTL', key)
local field, left = string.sub(h, 67, 82), nil
if string.sub(field, 1, 1) == 'k' then
  -- The lease is read off the key's expiry. A key with none (PERSIST by hand) says nothing
  -- about it: held (a conflict, no lease left to tell), never taken over, until an operator
  -- releases it.
  if pttl < 0 then return -1 end
  left = pttl - tonumber(string.sub(field, 2))
else
  left = tonumber(field) - now
end
if left <= 0 and string.sub(h, 3, 34) == string.sub(new, 3, 34) then
  -- The holder's lease lapsed: take over (new nonce, generation, lease), keep the key a lease.
  -- The expiry goes first: it is the first write, so a full Redis refuses before anything changed.
  gen = gen + 1
  local lease = tonumber(ARGV[2])
  local keep = pttl
  if pttl < lease then
    keep = lease
    redis.call('PEXPIRE', key, ARGV[2])
    if #KEYS > 1 and string.sub(head, 1, 1) == '3' then
      -- The scope counts the record as long as it lives (and again, should it have been
      -- pruned a moment before its key expired).
      local s = redis.call('GETRANGE', key, 82, 145)
      if redis.call('ZADD', KEYS[2], string.format('%.0f', now + lease), s .. ARGV[7]) == 1 then
        redis.call('HINCRBY', KEYS[3], 'n' .. s, 1)
      end
      if redis.call('PTTL', KEYS[2]) < lease then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
      if redis.call('PTTL', KEYS[3]) < lease then redis.call('PEXPIRE', KEYS[3], ARGV[2]) end
    end
  end
  if keep - lease <= 999999999999999 then
    field = string.format('k%015.0f', keep - lease)
  else
    field = string.format('%016.0f', now + lease)
  end
  redis.call('SETRANGE', key, 34, string.sub(new, 35, 50) .. string.format('%016.0f', gen) .. field)
  return {gen, -left}
end
return -1 - math.max(left, 0)
