-- Finish a stage and hand the turn to the next one, in one step: mark the stage done, store its
-- artifact, append its events, enqueue the next stage's message. The end of the admit stage also
-- accepts the turn: the conversation (when new) and the turn's pending message row exist from then.
-- KEYS[1] turn   KEYS[2] events   KEYS[3] this stage's artifact   KEYS[4] conversation's lease
-- KEYS[5] conversation   KEYS[6] conversation's messages   KEYS[7] conversation's message order
-- KEYS[8] next queue's messages   KEYS[9] next queue   KEYS[10] conversation's decision records
-- KEYS[11] the conversation's tenant's conversation index
-- KEYS[12] the worker's ack set of this stage's queue   KEYS[13] that queue's messages (with settle_id)
-- ARGV[1] JSON {stage, turn_id, fence ("" = not checked), now, artifact_ttl_ms, next_id,
--               next_queue, channel, events: [event...],
--               accept (absent, or {conversation: {field: value}, conversation_id, deadline_at,
--               message_id, creates (the turn starts the conversation)}),
--               decision (absent, or the stage's decision record as JSON text, kept under
--               "<message id = turn id>:<stage>"),
--               settle_id (absent, or the Redis id of this stage's own message: acked here, as
--               dispatch.lua's ack does, when the answer is 'ok')}
-- ARGV[2] the artifact   ARGV[3] the next stage's message   ARGV[4] the pending message row
-- Returns 'ok' | 'terminal' | 'done' | 'stale' | a refusal, nothing written: 'foreign_conversation'
-- (another tenant's), 'conversation_exists' (a first turn's conversation exists), 'message_exists'
-- (the message id names a row the turn did not write: its id was used before)
local turn, events = KEYS[1], KEYS[2]
local a = cjson.decode(ARGV[1])
local f = redis.call('HMGET', turn, 'status', 'done:' .. a.stage, 'message_id', 'seq')
if f[1] and TERMINAL[f[1]] then return 'terminal' end
if f[2] then return 'done' end
if a.fence ~= '' then
  local lease = redis.call('HMGET', KEYS[4], 'turn', 'fence')
  if lease[1] ~= a.turn_id or lease[2] ~= a.fence then return 'stale' end
end
if a.accept then
  local refusal = conversation_refusal(KEYS[5], KEYS[6], a.accept.conversation.tenant_id, a.accept.creates,
                                       a.accept.message_id)
  -- an accept the turn made before (a redelivery past its done marker) finds its own conversation and row
  local again = f[3] == a.accept.message_id
  if refusal and not (again and refusal ~= 'foreign_conversation') then return refusal end
  if redis.call('EXISTS', KEYS[5]) == 0 then
    local record = {}
    for field, value in pairs(a.accept.conversation) do
      record[#record + 1], record[#record + 2] = field, value
    end
    if #record > 0 then redis.call('HSET', KEYS[5], unpack(record)) end
  end
  redis.call('HSETNX', turn, 'deadline_at', a.accept.deadline_at)
  -- the row is there when the refusal passed over says so, or may be when another refusal was passed over
  local present = refusal == 'message_exists' or (refusal and redis.call('HEXISTS', KEYS[6], a.accept.message_id) == 1)
  if not present then
    redis.call('HSET', KEYS[6], a.accept.message_id, ARGV[4])
    redis.call('ZADD', KEYS[7], 'NX', redis.call('HINCRBY', KEYS[5], 'message_seq', 1), a.accept.message_id)
  end
  -- the tenant's listing, ordered by the last accepted turn; only a turn past the admit stage (whose scope
  -- matched) gets here, so no request can put another tenant's conversation in its own listing
  redis.call('ZADD', KEYS[11], a.now, a.accept.conversation_id)
end
if a.decision then redis.call('HSET', KEYS[10], a.turn_id .. ':' .. a.stage, a.decision) end
-- the events are numbered from the `seq` read above, written back with the stage's done marker
local seq = append_events(events, tonumber(f[4] or '0'), a.events)
-- until a worker begins the next stage, nobody holds the turn (holder ''): its message waits in a
-- queue. The running index keeps the score the stage's begin gave it: the watchdog that finds it due
-- reads `progress_at` (stalled.lua), so a hand-off needs no write of its own there.
if a.accept then
  redis.call('HSET', turn, 'done:' .. a.stage, a.now, 'progress_at', a.now, 'seq', seq, 'holder', '',
             'message_id', a.accept.message_id)
else
  redis.call('HSET', turn, 'done:' .. a.stage, a.now, 'progress_at', a.now, 'seq', seq, 'holder', '')
end
redis.call('SET', KEYS[3], ARGV[2], 'PX', a.artifact_ttl_ms)
enqueue(KEYS[8], KEYS[9], a.next_id, ARGV[3], a.channel, a.next_queue)
if a.settle_id and redis.call('SREM', KEYS[12], a.settle_id) > 0 then redis.call('HDEL', KEYS[13], a.settle_id) end
return 'ok'
