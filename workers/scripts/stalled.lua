-- Look at a turn that made no progress for a while (its worker may have died): 'alive' while a
-- model claim shows a run in progress; else the first stage not done, to be enqueued again, unless
-- the turn was recovered too often already ('exhausted': the caller ends it). The clock restarts.
-- KEYS[1] turn   KEYS[2] model claim   KEYS[3] running turns   KEYS[4] conversation's waiting requests
-- ARGV[1] JSON {turn_id, now, stages: [stage names in order], max_recoveries}
-- Returns {'gone'} | {'alive'} | {'exhausted', stage} | {'stalled', stage, attempt, request}
local turn = KEYS[1]
local a = cjson.decode(ARGV[1])
if redis.call('HGET', turn, 'status') ~= 'running' then
  redis.call('ZREM', KEYS[3], a.turn_id)
  return {'gone'}
end
redis.call('ZADD', KEYS[3], a.now, a.turn_id)
if redis.call('EXISTS', KEYS[2]) == 1 then return {'alive'} end
for _, stage in ipairs(a.stages) do
  if redis.call('HEXISTS', turn, 'done:' .. stage) == 0 then
    if redis.call('HINCRBY', turn, 'recoveries', 1) > a.max_recoveries then return {'exhausted', stage} end
    return {'stalled', stage, redis.call('HGET', turn, 'attempt') or '1', redis.call('HGET', KEYS[4], a.turn_id) or ''}
  end
end
return {'gone'}
