-- The one terminal write of a turn, exactly once: its message row, snapshot, the conversation's
-- tip and revision, usage and the terminal event. Then the turn's artifacts go, its record and
-- events expire, the conversation is released and the next turn in its line is woken.
-- KEYS[1] turn   KEYS[2] events   KEYS[3] cancel flag   KEYS[4] model claim   KEYS[5] running turns
-- KEYS[6] conversation   KEYS[7] messages   KEYS[8] snapshots   KEYS[9] lease   KEYS[10] line
-- KEYS[11] waiting requests   KEYS[12] the tenant's usage   KEYS[13] admit queue's messages
-- KEYS[14] admit queue   KEYS[15] activity index   KEYS[16] webhook delivery   KEYS[17] deliveries index
-- KEYS[18] webhook queue's messages   KEYS[19] webhook queue   KEYS[20] the conversation's message order
-- KEYS[21...] the turn's artifacts (a.artifacts of them), then, with a settle_id, the worker's ack set of
--   the finish stage's queue and that queue's messages
-- ARGV[1] JSON {artifacts (how many artifact keys), settle_id ("" = none; else the Redis id of the
--               finish stage's own message: acked here, as dispatch.lua's ack does, when the answer
--               is 'ok'), turn_id, status, conversation_id ("" = none), message_id ("" = not accepted),
--               fence, now, ttl_s, usage {name: count}, pending (JSON text), channel,
--               admit_queue, events: [event..., the terminal event last],
--               activity (keep the activity index: retention is on), tenant_id (the turn's),
--               webhook (absent: none; else {id, url, tenant_id, max_attempts, ttl_s, message_id, queue})}
-- ARGV[2] the message row   ARGV[3] the snapshot ("" = keep what is stored as it is)
-- ARGV[4] the webhook queue's first message ("" = no webhook)
-- The webhook delivery (docs/webhooks.md) is created and queued here, with the terminal event: once
-- per turn, however often the finish stage runs.
-- A row is written only into a conversation of the turn's own tenant, and only where the turn's
-- accept put its pending row; anything else is refused and nothing is written (the caller ends the
-- turn `failed` without a row).
-- A turn another turn interrupted (`on_busy`, prelude.lua) that ends `cancelled` keeps its partial
-- answer in a row marked `interrupted_by` — or, interrupted by a `rollback`, leaves the thread: its
-- pending row goes, and neither the tip nor the snapshots change (usage is still counted).
-- Returns {'ok'} | {'already', status} | {'stale'} | {'refused', 'foreign_conversation' | 'message_exists'}
local turn, events = KEYS[1], KEYS[2]
local a = cjson.decode(ARGV[1])
local f = redis.call('HMGET', turn, 'status', 'message_id', 'interrupted_by', 'rollback', 'seq')
local status = f[1]
if status and TERMINAL[status] then return {'already', status} end
local holder, fence = false, false
if a.conversation_id ~= '' then
  local lease = redis.call('HMGET', KEYS[9], 'turn', 'fence')
  holder, fence = lease[1], lease[2]
end
if a.message_id ~= '' then
  if holder ~= a.turn_id or fence ~= a.fence then return {'stale'} end
  if redis.call('HGET', KEYS[6], 'tenant_id') ~= a.tenant_id then return {'refused', 'foreign_conversation'} end
  if f[2] ~= a.message_id then return {'refused', 'message_exists'} end
  local interrupted = a.status == 'cancelled' and f[3]
  if interrupted and f[4] == '1' then
    redis.call('HDEL', KEYS[7], a.message_id)
    redis.call('ZREM', KEYS[20], a.message_id)
  else
    local row = ARGV[2]
    -- the row's JSON holds `"interrupted_by":null` once, as a field (inside a text, a quote is escaped)
    if interrupted then row = string.gsub(row, '"interrupted_by":null', '"interrupted_by":"' .. interrupted .. '"', 1) end
    redis.call('HSET', KEYS[7], a.message_id, row)
    if ARGV[3] ~= '' then redis.call('HSET', KEYS[8], a.message_id, ARGV[3]) end
    redis.call('HSET', KEYS[6], 'tip', a.message_id, 'pending', a.pending)
  end
  redis.call('HINCRBY', KEYS[6], 'revision', 1)
  for name, count in pairs(a.usage) do
    if count ~= 0 then redis.call('HINCRBY', KEYS[12], name, count) end  -- a counter never added reads 0
  end
  redis.call('HINCRBY', KEYS[12], 'turns', 1)
  if a.activity then redis.call('ZADD', KEYS[15], a.now, a.conversation_id) end
end
local seq = append_events(events, tonumber(f[5] or '0'), a.events)
redis.call('HSET', turn, 'status', a.status, 'finished_at', a.now, 'seq', seq)
redis.call('ZREM', KEYS[5], a.turn_id)
-- the cancel flag, the model claim and the artifacts: one DEL
redis.call('DEL', KEYS[3], KEYS[4], unpack(KEYS, 21, 20 + a.artifacts))
if a.webhook and redis.call('EXISTS', KEYS[16]) == 0 then
  local w = a.webhook
  local terminal = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)[1][2][2]
  redis.call('HSET', KEYS[16], 'turn_id', a.turn_id, 'tenant_id', w.tenant_id, 'url', w.url, 'status', 'pending',
             'attempts', 0, 'max_attempts', w.max_attempts, 'created_at', a.now, 'event', terminal)
  redis.call('EXPIRE', KEYS[16], w.ttl_s)
  redis.call('ZADD', KEYS[17], a.now, w.id)
  redis.call('ZREMRANGEBYSCORE', KEYS[17], '-inf', a.now - w.ttl_s)
  enqueue(KEYS[18], KEYS[19], w.message_id, ARGV[4], a.channel, w.queue)
end
redis.call('EXPIRE', turn, a.ttl_s)
redis.call('EXPIRE', events, a.ttl_s)
if a.conversation_id ~= '' then
  redis.call('ZREM', KEYS[10], a.turn_id)
  redis.call('HDEL', KEYS[11], a.turn_id)
  if holder == a.turn_id then redis.call('HDEL', KEYS[9], 'turn') end
  -- the lease as read above: free now unless another turn holds it
  local free = not holder or holder == a.turn_id
  local woken = free and wake_next(KEYS[10], KEYS[9], KEYS[11], KEYS[13], KEYS[14], a.channel, a.admit_queue,
                                   a.turn_id, true)
  if not woken and free and redis.call('EXISTS', KEYS[6]) == 0 then
    redis.call('DEL', KEYS[9])  -- no conversation and nobody waiting: leave nothing behind
    redis.call('ZREM', KEYS[15], a.conversation_id)
  end
end
if a.settle_id ~= '' and redis.call('SREM', KEYS[21 + a.artifacts], a.settle_id) > 0 then
  redis.call('HDEL', KEYS[22 + a.artifacts], a.settle_id)
end
return {'ok'}
