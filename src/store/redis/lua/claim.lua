-- Claims a record, or says what is there. KEYS[1] record; with quotas also KEYS[2] the
-- scope's records (a sorted set: record id by expiry ms) and KEYS[3] its bytes (a hash:
-- record id to size, 't' to the total).
-- ARGV[1] the new record's first 66 bytes: format, 'p', fingerprint, nonce, generation 1 (see
-- record.rs), ARGV[2] lease ms, ARGV[3] ms to keep a new record (max(ttl, lease)); with
-- quotas ARGV[4] the scope id in hex, ARGV[5] most records, ARGV[6] most bytes (0: no limit).
--
-- Replies: n > 0 claimed with generation n (new, or this nonce's own claim sent again);
-- {n, lapsed ms} taken over at generation n; 0 someone else's record, not in progress;
-- -1 - ms someone else's record in progress, with ms of lease left; the status QUOTA when
-- the scope is full. The record itself comes from the GET pipelined after this script, so its
-- answer never passes through Lua.
--
-- Reads before it writes: a full Redis refuses a script's first write, not the script, so an
-- existing record still comes back. TIME only where a lease matters. No helper functions:
-- defining them costs on every call.
local key, new = KEYS[1], ARGV[1]
local h = redis.call('GETRANGE', key, 0, 81)
if h == '' then
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  local value = new .. string.format('%016.0f', now + ARGV[2])
  if #KEYS == 1 then
    redis.call('SET', key, value, 'PX', ARGV[3])
    return 1
  end
  local z, b, most, budget = KEYS[2], KEYS[3], tonumber(ARGV[5]), tonumber(ARGV[6])
  value = value .. ARGV[4]
  -- Forget the scope's expired records (a bounded batch per claim). The byte total goes
  -- first: it is the one write a full Redis refuses, and then nothing has changed.
  local gone = redis.call('ZRANGEBYSCORE', z, '-inf', string.format('%.0f', now), 'LIMIT', 0, 500)
  if #gone > 0 then
    if budget > 0 then
      local sizes = redis.call('HMGET', b, unpack(gone))
      local freed = 0
      for i = 1, #sizes do freed = freed + (tonumber(sizes[i]) or 0) end
      redis.call('HINCRBY', b, 't', -freed)
      redis.call('HDEL', b, unpack(gone))
    end
    redis.call('ZREM', z, unpack(gone))
  end
  if most > 0 and redis.call('ZCARD', z) >= most then return {ok = 'QUOTA'} end
  if budget > 0 and (tonumber(redis.call('HGET', b, 't')) or 0) + #value > budget then
    return {ok = 'QUOTA'}
  end
  redis.call('SET', key, value, 'PX', ARGV[3])
  local id, keep = string.sub(key, -65, -2), tonumber(ARGV[3])
  redis.call('ZADD', z, string.format('%.0f', now + keep), id)
  if redis.call('PTTL', z) < keep then redis.call('PEXPIRE', z, ARGV[3]) end
  if budget > 0 then
    redis.call('HSET', b, id, #value)
    redis.call('HINCRBY', b, 't', #value)
    if redis.call('PTTL', b) < keep then redis.call('PEXPIRE', b, ARGV[3]) end
  end
  return 1
end
local head = string.sub(h, 1, 2)
if head ~= '2p' and head ~= '3p' then return 0 end
local gen = tonumber(string.sub(h, 51, 66))
-- Our own claim, sent again after a lost reply: fingerprint and nonce both match (equal
-- nonces alone never prove it is the same request).
if string.sub(h, 3, 50) == string.sub(new, 3, 50) then return gen end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local deadline = tonumber(string.sub(h, 67, 82))
if deadline <= now and string.sub(h, 3, 34) == string.sub(new, 3, 34) then
  -- The holder's lease lapsed: take over (new nonce, generation, lease), keep the key a lease.
  gen = gen + 1
  local lease = tonumber(ARGV[2])
  redis.call('SETRANGE', key, 34,
    string.sub(new, 35, 50) .. string.format('%016.0f%016.0f', gen, now + lease))
  if redis.call('PTTL', key) < lease then
    redis.call('PEXPIRE', key, ARGV[2])
    if #KEYS > 1 and head == '3p' then
      -- The scope counts the record as long as it lives.
      redis.call('ZADD', KEYS[2], string.format('%.0f', now + lease), string.sub(key, -65, -2))
      if redis.call('PTTL', KEYS[2]) < lease then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
    end
  end
  return {gen, now - deadline}
end
return -1 - math.max(deadline - now, 0)
