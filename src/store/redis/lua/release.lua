-- Frees the key. KEYS[1] record; ARGV[1] token (record bytes 35-66), ARGV[2] key prefix (for
-- a scope's keys). Replies 1, or 0 when fenced (not this token's, or completed): nothing
-- deleted. Absent: released by an earlier attempt, or expired; the key is free either way.
local key = KEYS[1]
local h = redis.call('GETRANGE', key, 0, 145)
if h == '' then return 1 end
if string.sub(h, 35, 66) ~= ARGV[1] or string.sub(h, 2, 2) ~= 'p' then return 0 end
redis.call('DEL', key)
if string.sub(h, 1, 1) == '3' then
  -- Give the scope its record back. Deletes work in a full Redis; the total is a write it
  -- may refuse (pcall): then the scope counts the bytes until its keys expire.
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
