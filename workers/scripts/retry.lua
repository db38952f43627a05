-- Give a failed model attempt another go later: release the claim, announce the retry, enqueue the
-- delayed message. The next start finds `retry_pending` and does not announce a lost worker.
-- KEYS[1] turn   KEYS[2] events   KEYS[3] model claim   KEYS[4] running turns
-- KEYS[5] the delay queue's messages   KEYS[6] the delay queue
-- ARGV[1] JSON {turn_id, now, message_id, queue, channel, event, claim (the caller's claim token)}
-- ARGV[2] the delayed message
-- Returns 'ok' | 'terminal' | 'stale'
local a = cjson.decode(ARGV[1])
local status = redis.call('HGET', KEYS[1], 'status')
if status and TERMINAL[status] then return 'terminal' end
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= a.claim then return 'stale' end  -- another worker runs the model now
redis.call('HSET', KEYS[1], 'retry_pending', '1')
redis.call('DEL', KEYS[3])
redis.call('ZADD', KEYS[4], a.now, a.turn_id)
emit(KEYS[1], KEYS[2], a.event)
enqueue(KEYS[5], KEYS[6], a.message_id, ARGV[2], a.channel, a.queue)
return 'ok'
