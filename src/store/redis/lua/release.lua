-- Frees the key. KEYS[1] record; with quotas KEYS[2] and KEYS[3] its scope group's records
-- and counts (see claim.lua). ARGV[1] token (record bytes 35-66), ARGV[2] the record id in
-- hex. Replies 1, or 0 when fenced (not this token's, or completed): nothing deleted. Absent:
-- released by an earlier attempt, or expired; the key is free either way.
local key = KEYS[1]
local h = redis.call('GETRANGE', key, 0, 145)
if h == '' then return 1 end
if string.sub(h, 35, 66) ~= ARGV[1] or string.sub(h, 2, 2) ~= 'p' then return 0 end
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
