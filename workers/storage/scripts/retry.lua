-- Give a model attempt another go: release the claim, announce the retry, enqueue the message (on
-- the delay queue after a failure; at once on the queue itself for a handover). The next start
-- finds `retry_pending` and does not announce a lost worker. A handover (the worker is shutting
-- down) is counted apart from failed attempts (`handovers`), so it costs the turn none of them.
-- KEYS[1] turn   KEYS[2] events   KEYS[3] model claim   KEYS[4] running turns
-- KEYS[5] the (delay) queue's messages   KEYS[6] the (delay) queue
-- ARGV[1] JSON {turn_id, now, message_id, queue, channel, event, claim (the caller's claim token),
--               handover (true: not a failed attempt)}
-- ARGV[2] the message
-- Returns 'ok' | 'terminal' | 'stale'
local a = cjson.decode(ARGV[1])
local status = redis.call('HGET', KEYS[1], 'status')
if status and TERMINAL[status] then return 'terminal' end
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= a.claim then return 'stale' end  -- another worker runs the model now
redis.call('HSET', KEYS[1], 'retry_pending', '1', 'progress_at', a.now)
redis.call('HDEL', KEYS[1], 'holder')
if a.handover then redis.call('HINCRBY', KEYS[1], 'handovers', 1) end
redis.call('DEL', KEYS[3])
redis.call('ZADD', KEYS[4], a.now, a.turn_id)
emit(KEYS[1], KEYS[2], a.event)
enqueue(KEYS[5], KEYS[6], a.message_id, ARGV[2], a.channel, a.queue)
return 'ok'
