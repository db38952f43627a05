-- A worker process says it is alive, and which turns it runs a stage of now: both keys expire unless
-- renewed, so a process that dies stops vouching for its turns within `ttl_ms`. The registry keeps
-- its broker id until the watchdog has put the messages it fetched back on their queues (reap.lua).
-- dramatiq's own heartbeat is renewed too (its clock: the worker's), so that dramatiq's maintenance
-- never takes the fetched messages of a live worker whose consumers are all busy.
-- With `stop` set, the process says goodbye instead: both keys go at once (the registry entry stays
-- for the watchdog, which requeues whatever it still had fetched).
-- KEYS[1] the worker's heartbeat   KEYS[2] its turns   KEYS[3] the workers registry
-- KEYS[4] dramatiq's heartbeats
-- ARGV[1] JSON {worker_id, broker_id, info (JSON text), ttl_ms, now_ms, turns: [turn ids], stop}
-- Returns the number of turns listed
local a = cjson.decode(ARGV[1])
redis.call('DEL', KEYS[2])
if a.stop then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], a.info, 'PX', a.ttl_ms)
redis.call('HSET', KEYS[3], a.worker_id, a.broker_id)
redis.call('ZADD', KEYS[4], a.now_ms, a.broker_id)
for _, turn_id in ipairs(a.turns) do redis.call('SADD', KEYS[2], turn_id) end
if #a.turns > 0 then redis.call('PEXPIRE', KEYS[2], a.ttl_ms) end
return #a.turns
