-- Record one attempt of a webhook delivery and, when it is retried, queue the next attempt (a
-- delayed message) in the same step. Only the attempt the delivery expects is recorded: a redelivered
-- or superseded message changes nothing.
-- KEYS[1] delivery   KEYS[2] its attempts   KEYS[3] the (delay) queue's messages   KEYS[4] the (delay) queue
-- ARGV[1] JSON {attempt, status (pending | retrying | delivered | failed), now, ttl_s, message_id
--               ("" = no next attempt), channel, queue}
-- ARGV[2] the attempt's record (JSON)   ARGV[3] the next attempt's message ("" = none)
-- Returns 'ok' | 'gone' (no such delivery) | 'stale' (not the attempt the delivery expects)
local a = cjson.decode(ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return 'gone' end
if tonumber(redis.call('HGET', KEYS[1], 'attempts')) ~= a.attempt - 1 then return 'stale' end
redis.call('HSET', KEYS[1], 'attempts', a.attempt, 'status', a.status, 'last_at', a.now)
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], redis.call('TTL', KEYS[1]) > 0 and redis.call('TTL', KEYS[1]) or a.ttl_s)
if a.message_id ~= '' then enqueue(KEYS[3], KEYS[4], a.message_id, ARGV[3], a.channel, a.queue) end
return 'ok'
