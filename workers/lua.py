"""The Lua scripts behind every write that must hang together.

Each script is one atomic step of a turn's state machine; all of them refuse to act on a turn that
already has its terminal state, which is what makes a redelivered message change nothing.

Cluster note: on one node, `finish` and `advance` touch conversation keys (one hash tag) and turn
keys in one script, and enqueue the next dramatiq message directly. The cluster variant keeps the
conversation write in one script and appends the terminal event guarded by the turn's transition.
"""

from __future__ import annotations

PRELUDE = r"""
local TERMINAL = {succeeded=true, paused=true, failed=true, cancelled=true, timed_out=true}

-- Append an event to a turn's stream, numbering it: the JSON comes without `seq`.
local function emit(turn, events, json)
  local seq = redis.call('HINCRBY', turn, 'seq', 1)
  redis.call('XADD', events, '*', 'json', '{"seq":' .. seq .. ',' .. string.sub(json, 2))
  return seq
end

-- Enqueue a dramatiq message exactly as RedisBroker.enqueue does, and ring the doorbell.
local function enqueue(ns, queue, id, data, channel)
  redis.call('HSET', ns .. ':' .. queue .. '.msgs', id, data)
  redis.call('RPUSH', ns .. ':' .. queue, id)
  redis.call('PUBLISH', channel, queue)
end

local function stage_started(turn_id, attempt, stage)
  return '{"type":"stage","turn_id":"' .. turn_id .. '","attempt":' .. attempt ..
         ',"stage":"' .. stage .. '","status":"started"}'
end
"""

#: Start a stage. KEYS: turn, events, cancel flag, artifact a, artifact b, invoke claim, running turns.
#: ARGV: stage, turn_id, now, check interrupts (cancel flag, deadline), claim token ("" = none),
#:       claim ttl ms, emit the `started` event ("1"/"0").
BEGIN = PRELUDE + r"""
local turn, events = KEYS[1], KEYS[2]
local stage, turn_id, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local status = redis.call('HGET', turn, 'status')
if status and TERMINAL[status] then return {'terminal', status} end
if redis.call('HEXISTS', turn, 'done:' .. stage) == 1 then return {'done'} end
local deadline = redis.call('HGET', turn, 'deadline_at')
if ARGV[4] == '1' then
  if redis.call('EXISTS', KEYS[3]) == 1 then return {'cancelled'} end
  if deadline and now > tonumber(deadline) then return {'timed_out'} end
end
local attempt = tonumber(redis.call('HGET', turn, 'attempt') or '1')
if ARGV[5] ~= '' then
  if redis.call('EXISTS', KEYS[6]) == 1 then return {'duplicate'} end
  redis.call('SET', KEYS[6], ARGV[5], 'PX', ARGV[6])
  attempt = redis.call('HINCRBY', turn, 'invoke_starts', 1)
  redis.call('HSET', turn, 'attempt', attempt)
  if attempt > 1 and redis.call('HDEL', turn, 'retry_pending') == 0 then
    emit(turn, events, '{"type":"retrying","turn_id":"' .. turn_id .. '","attempt":' .. attempt ..
         ',"reason":"redelivered: the worker running the previous attempt was lost"}')
  end
end
redis.call('HSET', turn, 'stage', stage)
redis.call('ZADD', KEYS[7], now, turn_id)
if ARGV[7] == '1' then emit(turn, events, stage_started(turn_id, attempt, stage)) end
return {'go', tostring(attempt), redis.call('GET', KEYS[4]) or '', redis.call('GET', KEYS[5]) or '',
        redis.call('HGET', turn, 'conversation_id') or '', redis.call('HGET', turn, 'fence') or '',
        redis.call('HGET', turn, 'deadline_at') or ''}
"""

#: Join a conversation's line of turns (if the producer did not already, see SUBMIT) by arrival
#: time; run now if first in line with the conversation free, else wait to be woken.
#: KEYS: turn, turn queue, lease, cancel flag, running turns.
#: ARGV: turn_id, (unused), now, conversation_id, wake id base, wake data, ttl s.
ADMIT = PRELUDE + r"""
local turn, queue, lease = KEYS[1], KEYS[2], KEYS[3]
local turn_id = ARGV[1]
local status = redis.call('HGET', turn, 'status')
if status and TERMINAL[status] then return {'terminal', status} end
if redis.call('HEXISTS', turn, 'done:resolve') == 1 then return {'done'} end
if redis.call('EXISTS', KEYS[4]) == 1 then return {'cancelled'} end
local t = redis.call('TIME')
redis.call('ZADD', queue, 'NX', t[1] * 1000000 + t[2], turn_id)
redis.call('HSET', turn, 'conversation_id', ARGV[4], 'wake_id', ARGV[5], 'wake_data', ARGV[6])
redis.call('EXPIRE', turn, ARGV[7])
local holder = redis.call('HGET', lease, 'turn')
if holder == turn_id then return {'admitted', redis.call('HGET', lease, 'fence')} end
local head = redis.call('ZRANGE', queue, 0, 0)[1]
if holder or head ~= turn_id then
  redis.call('HSET', turn, 'status', 'waiting')
  return {'waiting', holder or head}
end
local fence = redis.call('HINCRBY', lease, 'fence', 1)
redis.call('HSET', lease, 'turn', turn_id)
redis.call('HSET', turn, 'status', 'running', 'fence', fence, 'admitted_at', ARGV[3])
redis.call('ZADD', KEYS[5], ARGV[3], turn_id)
return {'admitted', tostring(fence)}
"""

#: Finish a stage and hand over to the next, atomically; the end of resolve also accepts the turn.
#: KEYS: turn, events, artifact out, conversation, messages, message order, lease, running turns.
#: ARGV: stage, turn_id, fence, artifact, artifact ttl ms, namespace, next queue, next id, next data,
#:       doorbell channel, now, accept JSON ({"conversation": fields, "deadline_at"}; "" = no),
#:       message id, message row, events...
ADVANCE = PRELUDE + r"""
local turn, events = KEYS[1], KEYS[2]
local stage, turn_id, fence = ARGV[1], ARGV[2], ARGV[3]
local status = redis.call('HGET', turn, 'status')
if status and TERMINAL[status] then return 'terminal' end
if redis.call('HEXISTS', turn, 'done:' .. stage) == 1 then return 'done' end
if fence ~= '' and (redis.call('HGET', KEYS[7], 'turn') ~= turn_id
                    or redis.call('HGET', KEYS[7], 'fence') ~= fence) then
  return 'stale'
end
if ARGV[12] ~= '' then
  local accept = cjson.decode(ARGV[12])
  if redis.call('EXISTS', KEYS[4]) == 0 then
    for field, value in pairs(accept.conversation) do redis.call('HSET', KEYS[4], field, value) end
  end
  redis.call('HSETNX', turn, 'deadline_at', accept.deadline_at)
  if redis.call('HEXISTS', KEYS[5], ARGV[13]) == 0 then
    redis.call('HSET', KEYS[5], ARGV[13], ARGV[14])
    redis.call('ZADD', KEYS[6], 'NX', redis.call('HINCRBY', KEYS[4], 'message_seq', 1), ARGV[13])
  end
  redis.call('HSET', turn, 'message_id', ARGV[13])
end
redis.call('HSET', turn, 'done:' .. stage, ARGV[11])
redis.call('ZADD', KEYS[8], ARGV[11], turn_id)
if ARGV[4] ~= '' then redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5]) end
for i = 15, #ARGV do emit(turn, events, ARGV[i]) end
enqueue(ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10])
return 'ok'
"""

#: Give a failed invoke attempt another go later. KEYS: turn, events, invoke claim, running turns.
#: ARGV: namespace, delayed queue, message id, message data, doorbell channel, retrying event, turn id,
#:       now.
RETRY = PRELUDE + r"""
local status = redis.call('HGET', KEYS[1], 'status')
if status and TERMINAL[status] then return 'terminal' end
redis.call('HSET', KEYS[1], 'retry_pending', '1')
redis.call('DEL', KEYS[3])
redis.call('ZADD', KEYS[4], ARGV[8], ARGV[7])
emit(KEYS[1], KEYS[2], ARGV[6])
enqueue(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
return 'ok'
"""

#: The one terminal write of a turn: message row, snapshot, conversation revision, usage and the
#: terminal event, exactly once; then release the conversation and wake the next turn in line.
#: KEYS: turn, events, conversation, messages, snapshots, lease, turn queue, usage, invoke claim,
#:       running turns.
#: ARGV: turn_id, status, terminal event, message id ("" = not accepted), message row, snapshot
#:       ("" = keep the previous), pending calls JSON, fence, namespace, doorbell channel, now,
#:       ttl s, input tokens, output tokens, requests, conversation id ("" = none), key prefix,
#:       events to append before the terminal one...
FINISH = PRELUDE + r"""
local turn, events = KEYS[1], KEYS[2]
local turn_id, message_id, conversation_id = ARGV[1], ARGV[4], ARGV[16]
local status = redis.call('HGET', turn, 'status')
if status and TERMINAL[status] then return {'already', status} end
local holder = false
if conversation_id ~= '' then holder = redis.call('HGET', KEYS[6], 'turn') end
if message_id ~= '' then
  if holder ~= turn_id or redis.call('HGET', KEYS[6], 'fence') ~= ARGV[8] then return {'stale'} end
  redis.call('HSET', KEYS[4], message_id, ARGV[5])
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[5], message_id, ARGV[6]) end
  redis.call('HSET', KEYS[3], 'tip', message_id, 'pending', ARGV[7])
  redis.call('HINCRBY', KEYS[3], 'revision', 1)
  redis.call('HINCRBY', KEYS[8], 'input_tokens', ARGV[13])
  redis.call('HINCRBY', KEYS[8], 'output_tokens', ARGV[14])
  redis.call('HINCRBY', KEYS[8], 'requests', ARGV[15])
  redis.call('HINCRBY', KEYS[8], 'turns', 1)
end
for i = 18, #ARGV do emit(turn, events, ARGV[i]) end
emit(turn, events, ARGV[3])
redis.call('HSET', turn, 'status', ARGV[2], 'finished_at', ARGV[11])
redis.call('ZREM', KEYS[10], turn_id)
redis.call('HDEL', turn, 'wake_data')
redis.call('DEL', KEYS[9])
redis.call('EXPIRE', turn, ARGV[12])
redis.call('EXPIRE', events, ARGV[12])
if conversation_id ~= '' then
  redis.call('ZREM', KEYS[7], turn_id)
  if holder == turn_id then redis.call('HDEL', KEYS[6], 'turn') end
  if redis.call('HEXISTS', KEYS[6], 'turn') == 0 then
    local head = redis.call('ZRANGE', KEYS[7], 0, 0)[1]
    if not head and redis.call('EXISTS', KEYS[3]) == 0 then
      redis.call('DEL', KEYS[6])  -- no conversation, nobody waiting: leave nothing behind
    end
    if head then
      local next_turn = ARGV[17] .. ':turn:' .. head
      local wake = redis.call('HGET', next_turn, 'wake_data')
      if wake then
        local id = redis.call('HGET', next_turn, 'wake_id') .. '.' .. redis.call('HINCRBY', next_turn, 'wakes', 1)
        local data = string.gsub(wake, '@@WAKE_ID@@', id)
        enqueue(ARGV[9], 'resolve', id, data, ARGV[10])
      end
    end
  end
end
return {'ok'}
"""

#: Look at a turn that made no progress for a while (its worker may have died): "alive" while an
#: invoke claim shows a run in progress, else the stage to run again. Either way its clock restarts.
#: KEYS: turn, invoke claim, running turns. ARGV: turn id, now.
STALLED = PRELUDE + r"""
local turn, turn_id = KEYS[1], ARGV[1]
local status = redis.call('HGET', turn, 'status')
if status ~= 'running' then
  redis.call('ZREM', KEYS[3], turn_id)
  return {'gone'}
end
redis.call('ZADD', KEYS[3], ARGV[2], turn_id)
if redis.call('EXISTS', KEYS[2]) == 1 then return {'alive'} end
for _, stage in ipairs({'resolve', 'history', 'map', 'invoke', 'persist'}) do
  if redis.call('HEXISTS', turn, 'done:' .. stage) == 0 then
    return {'stalled', stage, redis.call('HGET', turn, 'attempt') or '1',
            redis.call('HGET', turn, 'wake_id') or '', redis.call('HGET', turn, 'wake_data') or ''}
  end
end
return {'gone'}
"""

#: A producer's enqueue of a turn: the dramatiq message, the doorbell, and (for an existing
#: conversation) the turn's place in the conversation's line, by server time: submission order.
#: KEYS: queue messages hash, queue list, turn queue. ARGV: message id, data, doorbell channel,
#: queue name, turn id, register ("1"/"0").
SUBMIT = r"""
if ARGV[6] == '1' then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[3], 'NX', t[1] * 1000000 + t[2], ARGV[5])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
"""

#: Append one event. KEYS: turn, events. ARGV: event JSON (without seq).
EMIT = PRELUDE + r"""
local status = redis.call('HGET', KEYS[1], 'status')
if status and TERMINAL[status] then return 0 end
return emit(KEYS[1], KEYS[2], ARGV[1])
"""

#: Raise a turn's cancel flag (durable, with a TTL) and tell every worker process.
#: KEYS: cancel flag, turn. ARGV: reason, ttl s, cancel channel, turn id, now.
CANCEL = r"""
local status = redis.call('HGET', KEYS[2], 'status')
local terminal = {succeeded=true, paused=true, failed=true, cancelled=true, timed_out=true}
if status and terminal[status] then return {'noop', status} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[2], 'cancel_requested_at', ARGV[5])
if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
redis.call('PUBLISH', ARGV[3], ARGV[4])
return {'signalled', status or 'unknown'}
"""
