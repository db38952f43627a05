-- Take one of a limit's slots (`model.max_concurrency`, across every worker). The holders are a
-- sorted set of tokens scored by the expiry of their lease, in ms of this server's clock (no
-- worker's clock matters); a holder whose lease ran out belonged to a worker that died and is
-- dropped before counting.
-- KEYS[1] the limit's holders
-- ARGV[1] JSON {token, limit, lease_ms}
-- Returns {1, holders} when `token` holds a slot now (also when it held one already),
-- {0, holders} when every slot is taken

local a = cjson.decode(ARGV[1])
local now = slot_now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now))
local held = redis.call('ZSCORE', KEYS[1], a.token)
local count = redis.call('ZCARD', KEYS[1])
if not held and count >= a.limit then return {0, count} end
slot_hold(KEYS[1], a.token, now + a.lease_ms)
if held then return {1, count} end
return {1, count + 1}
