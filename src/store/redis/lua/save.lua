-- Saves a recovery point. KEYS[1] record (with quotas also its group's keys, unused here).
-- ARGV[1] token (nonce, generation: record bytes 35-66), ARGV[2] the point
-- (RecoveryPoint::encode). Replies 1, or 0 when fenced (not this token's, or not in
-- progress): nothing written.
--
-- The record becomes state 'r': its header, then the point in place of an answer. The key
-- keeps its expiry, so the header's lease field (a gap before the expiry, or a deadline:
-- claim.lua) still holds. A point is not counted against a scope's byte quota: it is capped
-- (RecoveryPoint::MAX_ENCODED) and gone once the record completes.
local key = KEYS[1]
local h = redis.call('GETRANGE', key, 0, 145)
local state = string.sub(h, 2, 2)
if string.sub(h, 35, 66) ~= ARGV[1] or (state ~= 'p' and state ~= 'r') then return 0 end
local n = 82
if string.sub(h, 1, 1) == '3' then n = 146 end
redis.call('SET', key, string.sub(h, 1, 1) .. 'r' .. string.sub(h, 3, n) .. ARGV[2], 'KEEPTTL')
return 1
