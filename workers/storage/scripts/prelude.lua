-- Shared by every script: workers/storage/lua.py puts it in front of each one, after the constants it
-- generates from their Python definitions (TERMINAL: pipeline/events.py's TERMINAL_TYPES).

-- Append an event to a turn's stream. `json` is the event without `seq` (and without `attempt`
-- when `attempt` is given): numbering is the store's, the rest of the event is the caller's.
local function emit(turn, events, json, attempt)
  local seq = redis.call('HINCRBY', turn, 'seq', 1)
  local head = '{"seq":' .. seq .. ','
  if attempt then head = head .. '"attempt":' .. attempt .. ',' end
  redis.call('XADD', events, '*', 'json', head .. string.sub(json, 2))
  return seq
end

-- Enqueue a dramatiq message exactly as RedisBroker.enqueue does, and ring the doorbell.
local function enqueue(msgs, list, id, data, channel, queue)
  redis.call('HSET', msgs, id, data)
  redis.call('RPUSH', list, id)
  redis.call('PUBLISH', channel, queue)
end

-- Server time in microseconds, as an exact decimal string (Lua's number format would round it).
local function now_us()
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', tonumber(t[2]))
end

-- A kept request (a dramatiq message whose ids are the placeholder @@WAKE_ID@@) with its ids set.
-- Only the two id fields match: inside the request's text a quote is escaped (\"), so the quoted
-- patterns below cannot occur there.
local function with_message_id(message, id)
  message = string.gsub(message, '"redis_message_id":"@@WAKE_ID@@"', '"redis_message_id":"' .. id .. '"')
  message = string.gsub(message, '"message_id":"@@WAKE_ID@@"', '"message_id":"' .. id .. '"')
  return message
end

-- Wake the first turn waiting in a conversation's line when nobody holds the conversation: enqueue
-- its kept request on the admit queue, under an id made of the waking and the woken turn.
local function wake_next(line, lease, waiting, msgs, list, channel, queue, by)
  if redis.call('HEXISTS', lease, 'turn') == 1 then return nil end
  local head = redis.call('ZRANGE', line, 0, 0)[1]
  if not head then return nil end
  local request = redis.call('HGET', waiting, head)
  if request then
    local id = 'wake.' .. head .. '.' .. by
    enqueue(msgs, list, id, with_message_id(request, id), channel, queue)
  end
  return head
end

-- Slots of a `model.max_concurrency` limit (slot_*.lua): this server's clock in ms (no worker's
-- clock matters); and a token's lease set to end at `expiry`, the set itself kept a little past its
-- longest lease (never forever).
local function slot_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function slot_hold(holders, token, expiry)
  redis.call('ZADD', holders, string.format('%.0f', expiry), token)
  local last = redis.call('ZRANGE', holders, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', holders, string.format('%.0f', tonumber(last[2]) + 1000))
end

-- Why a turn of `tenant` may not write into a conversation (nil: it may): the conversation is another
-- tenant's; or the turn would create it (`creates`) and it exists; or its message id names a row
-- already. A conversation's tenant is part of its record, so scope is checked where it is written.
local function conversation_refusal(conversation, messages, tenant, creates, message_id)
  local owner = redis.call('HGET', conversation, 'tenant_id')
  if owner and tenant and tenant ~= '' and owner ~= tenant then return 'foreign_conversation' end
  if owner and creates then return 'conversation_exists' end
  if redis.call('HEXISTS', messages, message_id) == 1 then return 'message_exists' end
  return nil
end
