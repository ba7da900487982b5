-- The index of records that saved a recovery point: one sorted set, KEYS[1], of record ids
-- (32 raw bytes) by when to look at them next, in ms by this node's TIME (microsecond
-- fractions, so two writes of one member never share a score). It is a hint: the recovery
-- worker reads every record it names before it acts, so a stale entry costs one read.
--
-- ARGV[1] the operation:
--   'add' ARGV[2] id: look at it from now on. Sent before the save itself, so a saved point
--     is always indexed.
--   'due' ARGV[2] count: up to count ids due now, oldest first, each followed by its score.
--   'drop' ARGV[2] id, ARGV[3] its score as 'due' read it: forget it, unless saved again
--     since (its score moved).
--   'later' ARGV[2] id, ARGV[3] its score as read, ARGV[4] ms: look again that much later
--     (a live lease), unless saved again since.
--   'forget' ARGV[2] id: forget it whatever its score (its record completed).
local z, op = KEYS[1], ARGV[1]
local t = redis.call('TIME')
local now = t[1] * 1000 + t[2] / 1000
if op == 'add' then
  return redis.call('ZADD', z, string.format('%.3f', now), ARGV[2])
elseif op == 'due' then
  return redis.call('ZRANGEBYSCORE', z, '-inf', string.format('%.3f', now), 'WITHSCORES', 'LIMIT', 0, ARGV[2])
elseif op == 'forget' then
  return redis.call('ZREM', z, ARGV[2])
end
if redis.call('ZSCORE', z, ARGV[2]) ~= ARGV[3] then return 0 end
if op == 'drop' then return redis.call('ZREM', z, ARGV[2]) end
redis.call('ZADD', z, string.format('%.3f', now + tonumber(ARGV[4])), ARGV[2])
return 1
