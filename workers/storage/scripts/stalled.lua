-- The watchdog's look at a running turn it has not looked at for a while. A turn a worker holds
-- (`holder`, set when a stage begins) is 'alive' while that worker's heartbeat lists it — however
-- long its model call streams — and, in a model stage, while the model claim lives (renewed from
-- the run itself). A turn whose holder is gone (the worker died, or stopped without handing it back)
-- is taken over at once; a turn nobody holds (its next stage's message waits in a queue, or was lost)
-- only after `stall_s` without progress. Taking over means: the dead holder's claim released, the
-- first stage not done to be enqueued again — unless the turn was recovered too often already
-- ('exhausted': the caller ends it). Every look moves the turn's score, so it is looked at again
-- only `recheck_s` later (or when its stall time is up).
-- KEYS[1] turn   KEYS[2] model claim   KEYS[3] running turns   KEYS[4] conversation's waiting requests
-- KEYS[5] the holder's turns (the set its heartbeat writes; any key when the turn has no holder);
--   absent in the sharded layout (another slot): the caller read it (`listed`)
-- ARGV[1] JSON {turn_id, now, stages: [stage names in order], model_stages: [names], max_recoveries,
--               holder (as the caller read it; "" = none), stall_s, recheck_s, listed (optional:
--               whether the holder's turns list the turn, as the caller read it)}
-- Returns {'gone'} | {'alive'} | {'waiting'} | {'exhausted', stage, why}
--       | {'stalled', stage, attempt, request, why}; why: 'worker_lost' | 'claim_lapsed' | 'no_progress'
local turn = KEYS[1]
local a = cjson.decode(ARGV[1])
if redis.call('HGET', turn, 'status') ~= 'running' then
  redis.call('ZREM', KEYS[3], a.turn_id)
  return {'gone'}
end
local holder = redis.call('HGET', turn, 'holder') or ''
local why
if holder ~= a.holder then
  redis.call('ZADD', KEYS[3], a.now, a.turn_id)  -- it moved on since the caller read it
  return {'alive'}
elseif holder ~= '' then
  local model, stage = false, redis.call('HGET', turn, 'stage')
  for _, name in ipairs(a.model_stages) do
    if name == stage then model = true end
  end
  local listed = a.listed
  if listed == nil then listed = redis.call('SISMEMBER', KEYS[5], a.turn_id) == 1 end
  if listed and (not model or redis.call('EXISTS', KEYS[2]) == 1) then
    redis.call('ZADD', KEYS[3], a.now, a.turn_id)
    return {'alive'}
  end
  why = listed and 'claim_lapsed' or 'worker_lost'
else
  if redis.call('EXISTS', KEYS[2]) == 1 then  -- a model call still claimed: it runs somewhere
    redis.call('ZADD', KEYS[3], a.now, a.turn_id)
    return {'alive'}
  end
  local progress = tonumber(redis.call('HGET', turn, 'progress_at') or redis.call('ZSCORE', KEYS[3], a.turn_id) or 0)
  if a.now - progress < a.stall_s then
    redis.call('ZADD', KEYS[3], progress + a.stall_s - a.recheck_s, a.turn_id)
    return {'waiting'}
  end
  why = 'no_progress'
end
if holder ~= '' then
  if redis.call('GET', KEYS[2]) == holder then redis.call('DEL', KEYS[2]) end
  redis.call('HDEL', turn, 'holder')
end
redis.call('ZADD', KEYS[3], a.now, a.turn_id)
redis.call('HSET', turn, 'progress_at', a.now)
for _, stage in ipairs(a.stages) do
  if redis.call('HEXISTS', turn, 'done:' .. stage) == 0 then
    if redis.call('HINCRBY', turn, 'recoveries', 1) > a.max_recoveries then return {'exhausted', stage, why} end
    return {'stalled', stage, redis.call('HGET', turn, 'attempt') or '1', redis.call('HGET', KEYS[4], a.turn_id) or '',
            why}
  end
end
return {'gone'}
