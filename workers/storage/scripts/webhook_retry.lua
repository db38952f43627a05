-- A manual retry (`threadline webhooks retry ID`): one more attempt of a delivery, now, whatever its
-- status; if it fails the delivery is `failed` again (no automatic attempts follow).
-- KEYS[1] delivery   KEYS[2] the webhook queue's messages   KEYS[3] the webhook queue
-- ARGV[1] JSON {attempt (the one queued: attempts + 1), message_id, channel, queue}
-- ARGV[2] the attempt's message
-- Returns 'ok' | 'not_found' | 'stale' (an attempt was recorded meanwhile: ask again)
local a = cjson.decode(ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return 'not_found' end
if tonumber(redis.call('HGET', KEYS[1], 'attempts')) ~= a.attempt - 1 then return 'stale' end
redis.call('HSET', KEYS[1], 'status', 'pending', 'max_attempts', a.attempt)
enqueue(KEYS[2], KEYS[3], a.message_id, ARGV[2], a.channel, a.queue)
return 'ok'
