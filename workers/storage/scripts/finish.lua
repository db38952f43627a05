-- The one terminal write of a turn, exactly once: its message row, snapshot, the conversation's
-- tip and revision, usage and the terminal event. Then the turn's artifacts go, its record and
-- events expire, the conversation is released and the next turn in its line is woken.
-- KEYS[1] turn   KEYS[2] events   KEYS[3] cancel flag   KEYS[4] model claim   KEYS[5] running turns
-- KEYS[6] conversation   KEYS[7] messages   KEYS[8] snapshots   KEYS[9] lease   KEYS[10] line
-- KEYS[11] waiting requests   KEYS[12] the tenant's usage   KEYS[13] admit queue's messages
-- KEYS[14] admit queue   KEYS[15] activity index   KEYS[16...] the turn's artifacts
-- ARGV[1] JSON {turn_id, status, conversation_id ("" = none), message_id ("" = not accepted),
--               fence, now, ttl_s, usage {name: count}, pending (JSON text), channel,
--               admit_queue, events: [event..., the terminal event last],
--               activity (keep the activity index: retention is on), tenant_id (the turn's)}
-- ARGV[2] the message row   ARGV[3] the snapshot ("" = keep what is stored as it is)
-- A row is written only into a conversation of the turn's own tenant, and only where the turn's
-- accept put its pending row; anything else is refused and nothing is written (the caller ends the
-- turn `failed` without a row).
-- Returns {'ok'} | {'already', status} | {'stale'} | {'refused', 'foreign_conversation' | 'message_exists'}
local turn, events = KEYS[1], KEYS[2]
local a = cjson.decode(ARGV[1])
local status = redis.call('HGET', turn, 'status')
if status and TERMINAL[status] then return {'already', status} end
local holder = false
if a.conversation_id ~= '' then holder = redis.call('HGET', KEYS[9], 'turn') end
if a.message_id ~= '' then
  if holder ~= a.turn_id or redis.call('HGET', KEYS[9], 'fence') ~= a.fence then return {'stale'} end
  if redis.call('HGET', KEYS[6], 'tenant_id') ~= a.tenant_id then return {'refused', 'foreign_conversation'} end
  if redis.call('HGET', turn, 'message_id') ~= a.message_id then return {'refused', 'message_exists'} end
  redis.call('HSET', KEYS[7], a.message_id, ARGV[2])
  if ARGV[3] ~= '' then redis.call('HSET', KEYS[8], a.message_id, ARGV[3]) end
  redis.call('HSET', KEYS[6], 'tip', a.message_id, 'pending', a.pending)
  redis.call('HINCRBY', KEYS[6], 'revision', 1)
  for name, count in pairs(a.usage) do redis.call('HINCRBY', KEYS[12], name, count) end
  redis.call('HINCRBY', KEYS[12], 'turns', 1)
  if a.activity then redis.call('ZADD', KEYS[15], a.now, a.conversation_id) end
end
for _, json in ipairs(a.events) do emit(turn, events, json) end
redis.call('HSET', turn, 'status', a.status, 'finished_at', a.now)
redis.call('ZREM', KEYS[5], a.turn_id)
redis.call('DEL', KEYS[3], KEYS[4])
for i = 16, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('EXPIRE', turn, a.ttl_s)
redis.call('EXPIRE', events, a.ttl_s)
if a.conversation_id ~= '' then
  redis.call('ZREM', KEYS[10], a.turn_id)
  redis.call('HDEL', KEYS[11], a.turn_id)
  if holder == a.turn_id then redis.call('HDEL', KEYS[9], 'turn') end
  local woken = wake_next(KEYS[10], KEYS[9], KEYS[11], KEYS[13], KEYS[14], a.channel, a.admit_queue, a.turn_id)
  if not woken and redis.call('HEXISTS', KEYS[9], 'turn') == 0 and redis.call('EXISTS', KEYS[6]) == 0 then
    redis.call('DEL', KEYS[9])  -- no conversation and nobody waiting: leave nothing behind
    redis.call('ZREM', KEYS[15], a.conversation_id)
  end
end
return {'ok'}
