-- A producer's enqueue of a turn: its place in its conversation's line by server time (submission
-- order holds from a conversation's first turn), the dramatiq message, and the doorbell. A turn
-- that already ended takes no place (a producer retrying its submission must not block the line).
-- With an owner (the gateway's tenant), the turn is recorded as that tenant's, once: a turn that
-- already exists is not enqueued again, and its owner (or "" when it has none) is returned instead.
-- Nor does it take a place in the line of another tenant's conversation: that is refused, and
-- nothing is written. A turn that names its `on_busy` policy has it applied here, atomically with its
-- place in the line (prelude.lua's `on_busy`): `reject` in a busy conversation writes nothing.
-- KEYS[1] the queue's messages   KEYS[2] the queue   KEYS[3] the conversation's line   KEYS[4] the turn
-- KEYS[5] the conversation (absent: not checked)   KEYS[6] its lease (with `on_busy`)
-- KEYS[7...] a turn key and a cancel flag key per victim named (`on_busy` interrupt or rollback)
-- ARGV[1] JSON {message_id, turn_id ("" = do not take a place in the line), channel, queue,
--               owner (absent or "": no owner recorded, enqueued whatever exists),
--               on_busy (absent: none named), victims, reason, rollback, cancel_ttl_s, cancel_channel, now}
-- ARGV[2] the dramatiq message
-- Returns 1 (enqueued) | {'exists', owner} | {'foreign_conversation'} | {'busy', turn id} | {'changed'}
local a = cjson.decode(ARGV[1])
if a.owner and a.owner ~= '' then
  if redis.call('EXISTS', KEYS[4]) == 1 then
    return {'exists', redis.call('HGET', KEYS[4], 'tenant_id') or ''}
  end
  local tenant = KEYS[5] and redis.call('HGET', KEYS[5], 'tenant_id')
  if tenant and tenant ~= a.owner then return {'foreign_conversation'} end
end
local status = redis.call('HGET', KEYS[4], 'status')
if a.turn_id ~= '' and not (status and TERMINAL[status]) then
  local verdict = on_busy(KEYS[3], KEYS[6], {unpack(KEYS, 7)}, a)
  if verdict then return verdict end
end
if a.owner and a.owner ~= '' then redis.call('HSET', KEYS[4], 'tenant_id', a.owner) end
if a.turn_id ~= '' and not (status and TERMINAL[status]) then
  redis.call('ZADD', KEYS[3], 'NX', now_us(), a.turn_id)
end
enqueue(KEYS[1], KEYS[2], a.message_id, ARGV[2], a.channel, a.queue)
return 1
