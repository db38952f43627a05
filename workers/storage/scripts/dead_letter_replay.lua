-- Put a dead-lettered message back on its queue as any producer enqueues one (body, id, doorbell)
-- and take it out of the dead-letter set, in one step. The body enqueued may differ from the one
-- kept (its retry count reset): it is written only while the kept body is still the one read.
-- KEYS[1] `<queue>.XQ`   KEYS[2] `<queue>.XQ.msgs`   KEYS[3] the queue's messages   KEYS[4] the queue
-- ARGV[1] JSON {message_id, channel, queue (the name rung on the doorbell)}
-- ARGV[2] the kept body as read   ARGV[3] the body to enqueue
-- Returns 'replayed' | 'missing' (no such dead letter) | 'changed' (the kept body is not ARGV[2])
-- | 'queued' (a message with this id waits on the queue: enqueuing would overwrite its body)
local a = cjson.decode(ARGV[1])
local kept = redis.call('HGET', KEYS[2], a.message_id)
if not kept then return 'missing' end
if kept ~= ARGV[2] then return 'changed' end
if redis.call('HEXISTS', KEYS[3], a.message_id) == 1 then return 'queued' end
enqueue(KEYS[3], KEYS[4], a.message_id, ARGV[3], a.channel, a.queue)
redis.call('ZREM', KEYS[1], a.message_id)
redis.call('HDEL', KEYS[2], a.message_id)
return 'replayed'
