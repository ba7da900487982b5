-- Renews a lease. KEYS[1] record; with quotas KEYS[2] and KEYS[3] its scope group's records
-- and counts (see claim.lua). ARGV[1] token (nonce, generation: record bytes 35-66), ARGV[2]
-- lease ms, ARGV[3] the record id in hex. Replies 1, or 0 when fenced (not this token's, or
-- completed): nothing written. The key lives at least one more lease.
local key = KEYS[1]
local h = redis.call('GETRANGE', key, 0, 145)
local state = string.sub(h, 2, 2)
if string.sub(h, 35, 66) ~= ARGV[1] or (state ~= 'p' and state ~= 'r') then return 0 end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lease = tonumber(ARGV[2])
-- The lease field is the gap between the lease's end and the key's expiry (see claim.lua),
-- rewritten with the expiry.
local keep = redis.call('PTTL', key)
if keep < lease then
  keep = lease
  redis.call('PEXPIRE', key, ARGV[2])
  if string.sub(h, 1, 1) == '3' and #KEYS == 3 then
    -- The scope counts the record as long as it lives.
    local scope = string.sub(h, 83, 146)
    if redis.call('ZADD', KEYS[2], string.format('%.0f', now + lease), scope .. ARGV[3]) == 1 then
      redis.call('HINCRBY', KEYS[3], 'n' .. scope, 1)
    end
    if redis.call('PTTL', KEYS[2]) < lease then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
    if redis.call('PTTL', KEYS[3]) < lease then redis.call('PEXPIRE', KEYS[3], ARGV[2]) end
  end
end
if keep - lease <= 999999999999999 then
  redis.call('SETRANGE', key, 66, string.format('k%015.0f', keep - lease))
else
  redis.call('SETRANGE', key, 66, string.format('%016.0f', now + lease))
end
return 1
