-- Shared by every script: workers/storage/lua.py puts it in front of each one, after the constants it
-- generates from their Python definitions (TERMINAL: pipeline/events.py's TERMINAL_TYPES).

-- Append one event numbered `seq` to a turn's stream. `json` is the event without `seq` (and without
-- `attempt` when `attempt` is given): numbering is the store's, the rest of the event is the caller's.
local function append_event(events, seq, json, attempt)
  local head = '{"seq":' .. seq .. ','
  if attempt then head = head .. '"attempt":' .. attempt .. ',' end
  redis.call('XADD', events, '*', 'json', head .. string.sub(json, 2))
end

-- Append an event to a turn's stream, numbered by the turn's `seq` field.
local function emit(turn, events, json, attempt)
  local seq = redis.call('HINCRBY', turn, 'seq', 1)
  append_event(events, seq, json, attempt)
  return seq
end

-- Append several events (as `emit`, without `attempt`) numbered from `seq`, the turn's `seq` field as
-- the calling script read it: the last number is returned, and the caller writes it back with its own
-- HSET of the turn (no HINCRBY of its own).
local function append_events(events, seq, list)
  for i, json in ipairs(list) do append_event(events, seq + i, json) end
  return seq + #list
end

-- Ring a doorbell: a shard's channel (the sharded layout's, named with its shard's hash tag, in the
-- calling script's slot) on sharded pub/sub, which a cluster delivers on that slot's node only;
-- one server's layout's plain channel with PUBLISH.
local function ring(channel, queue)
  if string.find(channel, '{', 1, true) then
    redis.call('SPUBLISH', channel, queue)
  else
    redis.call('PUBLISH', channel, queue)
  end
end

-- Enqueue a dramatiq message exactly as RedisBroker.enqueue does, and ring the doorbell when the
-- queue was empty. A consumer waits for a ring only after a fetch that took fewer messages than it
-- asked for, so that left the queue empty (workers/worker/broker.py, `DoorbellConsumer.__next__`);
-- the first message pushed after that rings, and a consumer that took as many as it asked for
-- fetches again without one.
local function enqueue(msgs, list, id, data, channel, queue)
  redis.call('HSET', msgs, id, data)
  if redis.call('RPUSH', list, id) == 1 then ring(channel, queue) end
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

-- Wake the first turn waiting in a conversation's line when nobody holds the conversation (`free`:
-- the caller knows nobody does): enqueue its kept request on the admit queue, under an id made of
-- the waking and the woken turn.
local function wake_next(line, lease, waiting, msgs, list, channel, queue, by, free)
  if not free and redis.call('HEXISTS', lease, 'turn') == 1 then return nil end
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

-- Raise a turn's cancel flag (durable, with a TTL) and tell every worker process (cancel.lua). The
-- turn's status ('unknown': not admitted yet), or nil for a turn that has ended: nothing to cancel.
local function raise_cancel(flag, turn, turn_id, reason, ttl_s, channel, now)
  local status = redis.call('HGET', turn, 'status')
  if status and TERMINAL[status] then return nil end
  redis.call('SET', flag, reason, 'EX', ttl_s)
  redis.call('HSET', turn, 'cancel_requested_at', now)
  if redis.call('TTL', turn) < 0 then redis.call('EXPIRE', turn, ttl_s) end
  redis.call('PUBLISH', channel, turn_id)
  return status or 'unknown'
end

-- Double texting (pipeline/busy.py). A conversation is busy for a turn when another holds it or
-- stands before the turn in its line (a turn not in the line yet: anyone in it): that turn's id.
local function busy_with(line, lease, turn_id)
  local holder = redis.call('HGET', lease, 'turn')
  if holder and holder ~= turn_id then return holder end
  local rank = redis.call('ZRANK', line, turn_id)
  local first = redis.call('ZRANGE', line, 0, 0)[1]
  if first and (rank == false or rank > 0) and first ~= turn_id then return first end
  return nil
end

-- The turns an interrupting turn cancels (pipeline/busy.py's `interrupt_victims`, same order): the
-- holder, then the interrupting turns placed before the turn (a negative place in the line).
local function busy_victims(line, lease, turn_id)
  local holder = redis.call('HGET', lease, 'turn')
  local victims = {}
  if holder and holder ~= turn_id then victims[1] = holder end
  local own = tonumber(redis.call('ZSCORE', line, turn_id) or '0')
  local bound = own < 0 and ('(' .. string.format('%.0f', own)) or '(0'
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', line, '-inf', bound)) do
    if id ~= turn_id and id ~= holder then victims[#victims + 1] = id end
  end
  return victims
end

-- Apply a turn's `on_busy` policy (a = {turn_id, on_busy, victims, reason, rollback, cancel_ttl_s,
-- cancel_channel, now}) where it joins its conversation's line. `victim_keys` holds a turn key and a
-- cancel flag key per victim the caller read, in `a.victims`' order. Returns nil (go on) | {'busy', id}
-- (reject: nothing written) | {'changed'} (the victims are not those the caller read: read again).
-- An interrupting turn marks and cancels its victims and takes a place before every waiting turn:
-- interrupting turns are placed at negative scores (their server time less 10^16 µs), so they
-- keep their own submission order and come before every turn placed by time.
local function on_busy(line, lease, victim_keys, a)
  if type(a.on_busy) ~= 'string' or a.on_busy == '' or a.on_busy == 'enqueue' then return nil end
  local busy = busy_with(line, lease, a.turn_id)
  if not busy then return nil end
  if a.on_busy == 'reject' then return {'busy', busy} end
  local victims = busy_victims(line, lease, a.turn_id)
  local named = type(a.victims) == 'table' and a.victims or {}
  if #victims ~= #named then return {'changed'} end
  for i, id in ipairs(victims) do
    if named[i] ~= id then return {'changed'} end
  end
  for i, id in ipairs(victims) do
    local turn, flag = victim_keys[2 * i - 1], victim_keys[2 * i]
    if raise_cancel(flag, turn, id, a.reason, a.cancel_ttl_s, a.cancel_channel, a.now) then
      redis.call('HSET', turn, 'interrupted_by', a.turn_id)
      if a.rollback then redis.call('HSET', turn, 'rollback', '1') end
    end
  end
  local score = tonumber(redis.call('ZSCORE', line, a.turn_id) or '0')
  if score >= 0 then
    local t = redis.call('TIME')
    redis.call('ZADD', line, string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]) - 1e16), a.turn_id)
  end
  return nil
end
