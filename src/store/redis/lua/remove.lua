-- The operator's delete. KEYS[1] record; with quotas KEYS[2] and KEYS[3] its scope group's
-- records and counts (see claim.lua). ARGV[1] 'p' to remove a record in progress, 'c' a
-- completed one; ARGV[2] the record id in hex. Replies 0 absent, 1 removed, 2 refused (the
-- other state). ARGV[3] the channel that hears of removed completed records (local tiers on
-- other processes drop them): published in the script, so no removal goes unsaid.
local key = KEYS[1]
local h = redis.call('GETRANGE', key, 0, 145)
if h == '' then return 0 end
local state = string.sub(h, 2, 2)
if state == 'r' then state = 'p' end
if state ~= ARGV[1] then return 2 end
redis.call('DEL', key)
if state == 'c' then redis.call('PUBLISH', ARGV[3], ARGV[2]) end
if string.sub(h, 1, 1) == '3' and #KEYS == 3 then
  -- As in release.lua: give the scope its record back.
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
