-- A worker process whose heartbeat is gone: put every message it had fetched and not acked back on
-- its queue (as dramatiq's maintenance does, but at once instead of after its 60 s heartbeat timeout
-- and a random pass), ring the doorbell for those queues, and forget the worker. A message already
-- handled (no body left) is only dropped from the ack set. Refuses while the heartbeat lives.
-- In the sharded layout the worker's keys and each shard's queues are in different slots: the caller
-- puts each shard's queues back in one call without the worker's keys (`fleet` false), then forgets
-- the worker in a call with no queues.
-- KEYS[1] the workers registry   KEYS[2] the worker's heartbeat   KEYS[3] dramatiq's heartbeats
--   (without `fleet`: none of the three)
-- then triples per queue: the worker's ack set, the queue's messages, the queue
-- ARGV[1] JSON {worker_id, broker_id, channel, queues: [queue name per triple], fleet}
-- Returns -1 when the worker is alive, else the number of messages put back
local a = cjson.decode(ARGV[1])
local first = a.fleet and 3 or 0
if a.fleet and redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local requeued = 0
for i, queue in ipairs(a.queues) do
  local acks, msgs, list = KEYS[first - 2 + 3 * i], KEYS[first - 1 + 3 * i], KEYS[first + 3 * i]
  local ids = redis.call('SMEMBERS', acks)
  local moved = 0
  for _, id in ipairs(ids) do
    if redis.call('HEXISTS', msgs, id) == 1 then
      redis.call('RPUSH', list, id)
      moved = moved + 1
    end
  end
  redis.call('DEL', acks)
  if moved > 0 then ring(a.channel, queue) end
  requeued = requeued + moved
end
if a.fleet then
  redis.call('HDEL', KEYS[1], a.worker_id)
  redis.call('ZREM', KEYS[3], a.broker_id)
end
return requeued
