-- Start a stage of a turn. Refuses when the turn has ended, the stage ran already, or (when asked)
-- the turn is cancelled or past its deadline; takes the model claim when asked (a second delivery
-- of the same model call stays out while the claim lives); announces the start.
-- A cancel is read off the turn's record (`cancel_requested_at`, which raise_cancel writes with the
-- flag). The start scores the turn in the running index: the watchdog looks at it once that score
-- is older than the worker timeout, when a dead holder's heartbeat has lapsed (a score left older
-- would bring a look while the holder still seems alive, and the takeover a whole interval later).
-- A start less than `rescore_s` after the last start or admission that scored it (`scored_at`)
-- leaves the score as it is, at most that much older: no look can have come in between (a look
-- needs a score older than the worker timeout and the stall time, which `rescore_s` is well under),
-- so nothing since moved it later, and the next look comes at most `rescore_s` earlier.
-- KEYS[1] turn   KEYS[2] events   KEYS[3] the admit stage's artifact   KEYS[4] the previous stage's artifact
-- KEYS[5] model claim   KEYS[6] running turns
-- ARGV[1] JSON {stage, turn_id, now, interrupts (check cancel and deadline), claim (token or ""),
--               claim_ttl_ms, holder (the worker id running the stage, or ""), rescore_s,
--               started (event, or ""), redelivered (event)}; both events come
--               without seq and attempt: a claim decides the attempt.
-- Returns {'go', attempt, admit artifact, previous artifact, conversation id, fence, deadline, handovers}
--       | {'unknown'} | {'terminal', status} | {'done'} | {'cancelled'} | {'timed_out'} | {'duplicate'}
local turn, events = KEYS[1], KEYS[2]
local a = cjson.decode(ARGV[1])
-- every field the script reads, in one round inside the server (none of them changes below but
-- `attempt`, `model_starts` and `seq`, which are computed here)
local f = redis.call('HMGET', turn, 'status', 'done:' .. a.stage, 'deadline_at', 'attempt', 'conversation_id',
                     'fence', 'handovers', 'retry_pending', 'seq', 'model_starts', 'cancel_requested_at',
                     'scored_at')
local status, done, deadline = f[1], f[2], f[3]
if not status then return {'unknown'} end  -- no such turn (or its record expired): nothing to run
if TERMINAL[status] then return {'terminal', status} end
if done then return {'done'} end
if a.interrupts then
  if f[11] then return {'cancelled'} end
  if deadline and a.now > tonumber(deadline) then return {'timed_out'} end
end
local attempt = tonumber(f[4] or '1')
local fields = {'stage', a.stage, 'progress_at', a.now}
-- events are numbered from the `seq` read above, written back with the fields below
local seq = tonumber(f[9] or '0')
if a.claim ~= '' then
  if not redis.call('SET', KEYS[5], a.claim, 'NX', 'PX', a.claim_ttl_ms) then return {'duplicate'} end
  attempt = tonumber(f[10] or '0') + 1
  fields[#fields + 1], fields[#fields + 2] = 'model_starts', attempt
  fields[#fields + 1], fields[#fields + 2] = 'attempt', attempt
  -- a start that no retry scheduled: the worker of the previous attempt was lost
  if attempt > 1 then
    if f[8] then redis.call('HDEL', turn, 'retry_pending')
    else seq = seq + 1; append_event(events, seq, a.redelivered, attempt) end
  end
end
-- the watchdog takes the turn over as soon as its holder's heartbeat no longer lists it
fields[#fields + 1], fields[#fields + 2] = 'holder', a.holder or ''
if a.started ~= '' then
  seq = seq + 1
  append_event(events, seq, a.started, attempt)
end
fields[#fields + 1], fields[#fields + 2] = 'seq', seq
local rescore = not f[12] or a.now - tonumber(f[12]) >= a.rescore_s
if rescore then fields[#fields + 1], fields[#fields + 2] = 'scored_at', a.now end
redis.call('HSET', turn, unpack(fields))
if rescore then redis.call('ZADD', KEYS[6], a.now, a.turn_id) end
local artifacts = redis.call('MGET', KEYS[3], KEYS[4])
return {'go', tostring(attempt), artifacts[1] or '', artifacts[2] or '', f[5] or '', f[6] or '', deadline or '',
        f[7] or '0'}
