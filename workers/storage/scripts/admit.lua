-- Take a turn's place in its conversation's line (unless its producer took it at submission), keep
-- its request so that the turn before it can wake it, and run it now if it is first in line and
-- the conversation is free; otherwise it waits.
-- A turn of another tenant's conversation, a first turn whose conversation exists already, or a
-- turn whose message id (its turn id) names a row already is refused, and nothing is written: ids
-- outlive turn records, so the check is here, where the turn joins the conversation.
-- On its first admission, the turn's `on_busy` policy is applied (prelude.lua's `on_busy`): a
-- `reject` turn of a busy conversation is refused with nothing written; an interrupting one cancels
-- the turns in its way and takes the place before every waiting turn.
-- A turn admitted here also begins its admit stage, as begin.lua would (its checks are the ones
-- above: nothing else can stop a stage that is not done yet): the stage, its holder and its
-- progress go in the turn's record and its running score is now (with `scored_at`: see begin.lua);
-- the stage's `started` event comes with its hand-over, after `accepted`.
-- KEYS[1] turn   KEYS[2] running turns   KEYS[3] conversation's line   KEYS[4] conversation's lease
-- KEYS[5] conversation's waiting requests   KEYS[6] admit queue's messages   KEYS[7] admit queue
-- KEYS[8] activity index   KEYS[9] conversation   KEYS[10] its messages
-- KEYS[11...] a turn key and a cancel flag key per victim named (`on_busy` interrupt or rollback)
-- ARGV[1] JSON {turn_id, conversation_id, now, stage (the admit stage), holder (the worker id running
--               it, or ""), channel, queue,
--               activity (keep the activity index: retention is on), tenant_id ("" = not checked),
--               creates (the turn starts the conversation),
--               on_busy ("" = enqueue), victims, reason, rollback, cancel_ttl_s, cancel_channel}
-- ARGV[2] the turn's request as a dramatiq message whose id is a placeholder (see finish.lua)
-- Returns {'admitted', fence, attempt, handovers} | {'waiting', ahead} | {'terminal', status} | {'done'}
--       | {'cancelled'} | {'refused', 'foreign_conversation' | 'conversation_exists' | 'message_exists'}
--       | {'busy', the turn in the way} | {'changed'} (the victims named are not the turns in the way)
local turn = KEYS[1]
local a = cjson.decode(ARGV[1])
local f = redis.call('HMGET', turn, 'status', 'done:' .. a.stage, 'attempt', 'handovers', 'cancel_requested_at')
local status = f[1]
if status and TERMINAL[status] then
  -- an ended turn submitted again (a producer retrying) must not stand in its conversation's line
  if redis.call('ZREM', KEYS[3], a.turn_id) == 1 then
    wake_next(KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], a.channel, a.queue, a.turn_id)
  end
  return {'terminal', status}
end
if f[2] then return {'done'} end
-- a cancel is read off the turn's record: raise_cancel writes `cancel_requested_at` with the flag, also
-- for a turn not submitted yet, and the field outlives the flag's TTL (a turn cancelled while it waited)
if f[5] then return {'cancelled'} end
local refusal = conversation_refusal(KEYS[9], KEYS[10], a.tenant_id, a.creates, a.turn_id)
if refusal then return {'refused', refusal} end
if not status then
  local verdict = on_busy(KEYS[3], KEYS[4], {unpack(KEYS, 11)}, a)
  if verdict then return verdict end
end
redis.call('ZADD', KEYS[3], 'NX', now_us(), a.turn_id)
redis.call('HSET', KEYS[5], a.turn_id, ARGV[2])
redis.call('PERSIST', turn)  -- a live turn's record never expires; finish.lua sets its expiry
if a.activity then redis.call('ZADD', KEYS[8], a.now, a.conversation_id) end
local lease = redis.call('HMGET', KEYS[4], 'turn', 'fence')
local holder = lease[1]
local begun = {'stage', a.stage, 'progress_at', a.now, 'holder', a.holder, 'scored_at', a.now}
local fence
if holder == a.turn_id then
  -- admitted before (a redelivery, or the turn before it woke it): its record has its conversation
  fence = lease[2]
  redis.call('HSET', turn, unpack(begun))
else
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  if holder or head ~= a.turn_id then
    redis.call('HSET', turn, 'status', 'waiting', 'conversation_id', a.conversation_id)
    return {'waiting', holder or head}
  end
  fence = redis.call('HINCRBY', KEYS[4], 'fence', 1)
  redis.call('HSET', KEYS[4], 'turn', a.turn_id)
  redis.call('HSET', turn, 'status', 'running', 'fence', fence, 'admitted_at', a.now, 'conversation_id',
             a.conversation_id, unpack(begun))
end
redis.call('ZADD', KEYS[2], a.now, a.turn_id)
return {'admitted', tostring(fence), f[3] or '1', f[4] or '0'}
