-- Releases a claim. KEYS[1] record; with quotas KEYS[2] and KEYS[3] its scope group's records
-- and counts (see claim.lua). ARGV[1] token (record bytes 35-66), ARGV[2] the record id in
-- hex, ARGV[3] the token's released token (Token::released: the same generation, a nonce no
-- claim holds). Replies 1, or 0 when fenced (not this token's, or completed): nothing changed.
--
-- A first claim (generation 1) is deleted: a retry runs as a new first attempt. A takeover
-- is kept, because an earlier attempt may have done work: it holds the released token from
-- now on (so this token is fenced) and its lease ends now, by Redis's clock, so the next
-- claim of the same request takes over with generation + 1 and is told so. Its expiry and
-- its scope's counts stay as they were.
--
-- Absent: released by an earlier attempt, or expired; the key is free either way. Holding the
-- released token: kept by an earlier attempt of this release.
local key = KEYS[1]
local h = redis.call('GETRANGE', key, 0, 145)
if h == '' then return 1 end
local state = string.sub(h, 2, 2)
if state ~= 'p' and state ~= 'r' then return 0 end
local held = string.sub(h, 35, 66)
if held == ARGV[3] then return 1 end
if held ~= ARGV[1] then return 0 end
if string.sub(h, 51, 66) ~= '0000000000000001' then
  -- Same length: the record grows by nothing. It is still a write, which a full Redis refuses
  -- (the key then waits out its lease, and is taken over all the same).
  -- The lease ends now: its gap to the key's expiry (see claim.lua) is the key's TTL.
  local pttl, field = redis.call('PTTL', key), nil
  if pttl >= 0 and pttl <= 999999999999999 then
    field = string.format('k%015.0f', pttl)
  else
    local t = redis.call('TIME')
    field = string.format('%016.0f', t[1] * 1000 + math.floor(t[2] / 1000))
  end
  if state == 'r' then
    -- The recovery point goes with the claim: the header alone, in progress ('p').
    local n = 82
    if string.sub(h, 1, 1) == '3' then n = 146 end
    redis.call('SET', key, string.sub(h, 1, 1) .. 'p' .. string.sub(h, 3, 34) .. ARGV[3]
      .. field .. string.sub(h, 83, n), 'KEEPTTL')
    return 1
  end
  redis.call('SETRANGE', key, 34, ARGV[3] .. field)
  return 1
end
redis.call('DEL', key)
if string.sub(h, 1, 1) == '3' and #KEYS == 3 then
  -- Give the scope its record back. A full Redis refuses only a script's first write, and
  -- this one's was the DEL; pcall all the same: were the count refused, the member would stay,
  -- counted until it expires and a claim prunes it, never counted twice.
  local z, b, scope = KEYS[2], KEYS[3], string.sub(h, 83, 146)
  local member = scope .. ARGV[2]
  if redis.call('ZSCORE', z, member) then
    if type(redis.pcall('HINCRBY', b, 'n' .. scope, -1)) == 'number' then
      local size = tonumber(redis.call('HGET', b, ARGV[2])) or 0
      redis.call('HINCRBY', b, 't' .. scope, -size)
      redis.call('HDEL', b, ARGV[2])
      redis.call('ZREM', z, member)
    end
  end
end
return 1
