-- Raise a turn's cancel flag (durable, with a TTL) and tell every worker process; a no-op for a
-- turn that has ended.
-- KEYS[1] cancel flag   KEYS[2] turn
-- ARGV[1] JSON {turn_id, reason, ttl_s, channel, now}
-- Returns {'noop', status} | {'signalled', status or 'unknown'}
local a = cjson.decode(ARGV[1])
local status = redis.call('HGET', KEYS[2], 'status')
if status and TERMINAL[status] then return {'noop', status} end
redis.call('SET', KEYS[1], a.reason, 'EX', a.ttl_s)
redis.call('HSET', KEYS[2], 'cancel_requested_at', a.now)
if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], a.ttl_s) end
redis.call('PUBLISH', a.channel, a.turn_id)
return {'signalled', status or 'unknown'}
