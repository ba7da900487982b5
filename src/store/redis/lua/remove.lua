-- The operator's delete. KEYS[1] record; ARGV[1] 'p' to remove a record in progress, 'c' a
-- completed one; ARGV[2] key prefix (for a scope's keys). Replies 0 absent, 1 removed, 2
-- refused (the other state).
local key = KEYS[1]
local h = redis.call('GETRANGE', key, 0, 145)
if h == '' then return 0 end
if string.sub(h, 2, 2) ~= ARGV[1] then return 2 end
redis.call('DEL', key)
if string.sub(h, 1, 1) == '3' then
  -- As in release.lua: give the scope its record back.
  local scope, id = string.sub(h, 83, 146), string.sub(key, -65, -2)
  local b = ARGV[2] .. 'b:' .. scope
  redis.call('ZREM', ARGV[2] .. 's:' .. scope, id)
  local size = tonumber(redis.call('HGET', b, id))
  if size then
    redis.call('HDEL', b, id)
    redis.pcall('HINCRBY', b, 't', -size)
  end
end
return 1
