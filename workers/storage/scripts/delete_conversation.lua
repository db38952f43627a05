-- Delete a conversation and everything of it, in one step: its own keys (the `{conversation}` hash
-- tag) and every key of its turns, which also leave the running set and the activity index. It
-- refuses while a turn of the conversation runs or waits: a turn holding the lease would write a
-- half-deleted conversation back. The caller reads the message rows first (their turns' keys must
-- arrive in KEYS); rows that changed since then make it answer 'changed', to be read again.
-- KEYS[1] conversation   KEYS[2] messages   KEYS[3] line   KEYS[4] lease   KEYS[5] waiting requests
-- KEYS[6] running turns   KEYS[7] activity index   KEYS[8] the tenant's conversation index (of the
-- tenant the caller read from the conversation)   KEYS[9...] every other key to delete: the rest of
-- the conversation's keys, then each turn's keys
-- ARGV[1] JSON {conversation_id, tenant_id ("" = any), messages: [message id...] (the rows read),
--               turns: [turn id...] (theirs), stored_tenant (the tenant KEYS[8] is the index of)}
-- Returns {'deleted', messages, turns} | {'not_found'} | {'busy', turn...} | {'changed'}
local conv, msgs, line, lease, waiting = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local a = cjson.decode(ARGV[1])
local holder = redis.call('HGET', lease, 'turn')
local queued = redis.call('ZRANGE', line, 0, 49)
local busy = holder or #queued > 0 or redis.call('HLEN', waiting) > 0
local tenant = redis.call('HGET', conv, 'tenant_id')
if not tenant then
  -- an index entry without a conversation (its first turn never created it) goes, unless a turn is on its way
  if not busy then redis.call('ZREM', KEYS[7], a.conversation_id) end
  return {'not_found'}
end
-- another tenant's conversation is indistinguishable from a missing one
if a.tenant_id ~= '' and tenant ~= a.tenant_id then return {'not_found'} end
if busy then
  local out = {'busy'}
  if holder then table.insert(out, holder) end
  for _, turn in ipairs(queued) do
    if turn ~= holder then table.insert(out, turn) end
  end
  return out
end
if tenant ~= a.stored_tenant or redis.call('HLEN', msgs) ~= #a.messages then return {'changed'} end
for _, id in ipairs(a.messages) do
  if redis.call('HEXISTS', msgs, id) == 0 then return {'changed'} end
end
for _, turn in ipairs(a.turns) do redis.call('ZREM', KEYS[6], turn) end
redis.call('ZREM', KEYS[7], a.conversation_id)
redis.call('ZREM', KEYS[8], a.conversation_id)
redis.call('DEL', conv, msgs, line, lease, waiting)
for i = 9, #KEYS, 500 do redis.call('DEL', unpack(KEYS, i, math.min(i + 499, #KEYS))) end
return {'deleted', #a.messages, #a.turns}
