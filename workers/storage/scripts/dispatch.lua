-- The broker's queue commands (DoorbellBroker._dispatch), in place of dramatiq's dispatch.lua: the
-- same commands on the same keys and the same message bytes, but every key arrives in KEYS (dramatiq
-- builds its key names inside Lua from its namespace, which no cluster can route), and a call does
-- only its command. dramatiq's per-call heartbeat write and its random maintenance pass are the
-- worker's heartbeat (heartbeat.lua) and the watchdog's reap (reap.lua) here, which put a dead
-- worker's fetched messages back at once instead of after a minute; expired dead letters are
-- dropped when a message is dead-lettered.
-- KEYS[1] the queue (list of message ids)   KEYS[2] its messages (hash id -> body)
-- KEYS[3] this worker's ack set of the queue   KEYS[4] the dead-letter set (the canonical queue's)
-- KEYS[5] the dead-letter bodies
-- qsize instead: KEYS[1] the queue's messages   KEYS[2] the ack set   KEYS[3] the delay queue's
--   messages   KEYS[4] its ack set
-- ARGV[1] command   ARGV[2] now (ms)   ARGV[3] max unpack size   ARGV[4...] the command's arguments
-- fetch returns id, body pairs (unlike dramatiq's bodies alone): the consumer checks that a body's
-- `options.redis_message_id` is the id it is stored under, or it would ack another message.
local command, now, max_unpack = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])

if command == 'enqueue' then
  -- id, body, doorbell channel, queue name
  enqueue(KEYS[2], KEYS[1], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
  return 1
elseif command == 'fetch' or command == 'ack' then
  -- ack: ids; fetch: how many, then the ids of messages to ack first (the consumer's unsent acks)
  local first = command == 'fetch' and 5 or 4
  for i = first, #ARGV do
    if redis.call('SREM', KEYS[3], ARGV[i]) > 0 then redis.call('HDEL', KEYS[2], ARGV[i]) end
  end
  if command == 'ack' then return 1 end
  local ids = redis.call('LPOP', KEYS[1], math.min(tonumber(ARGV[4]), max_unpack))  -- false: the queue is empty
  if not ids or #ids == 0 then return {} end  -- a count of 0 takes nothing
  redis.call('SADD', KEYS[3], unpack(ids))
  local bodies, out = redis.call('HMGET', KEYS[2], unpack(ids)), {}
  for i, id in ipairs(ids) do
    out[2 * i - 1], out[2 * i] = id, bodies[i]
  end
  return out
elseif command == 'nack' then
  -- id, dead-letter ttl (ms)
  local id = ARGV[4]
  if redis.call('SREM', KEYS[3], id) > 0 then
    local body = redis.call('HGET', KEYS[2], id)
    if body then
      redis.call('ZADD', KEYS[4], now, id)
      redis.call('HSET', KEYS[5], id, body)
      redis.call('HDEL', KEYS[2], id)
    end
  end
  local expired = redis.call('ZRANGEBYSCORE', KEYS[4], 0, now - tonumber(ARGV[5]), 'LIMIT', 0, max_unpack)
  if #expired > 0 then
    redis.call('ZREM', KEYS[4], unpack(expired))
    redis.call('HDEL', KEYS[5], unpack(expired))
  end
  return 1
elseif command == 'requeue' then
  for i = 4, #ARGV do
    if redis.call('SREM', KEYS[3], ARGV[i]) > 0 and redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
      redis.call('RPUSH', KEYS[1], ARGV[i])
    end
  end
  return 1
elseif command == 'purge' then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  return 1
elseif command == 'qsize' then
  return redis.call('HLEN', KEYS[1]) + redis.call('SCARD', KEYS[2]) + redis.call('HLEN', KEYS[3])
    + redis.call('SCARD', KEYS[4])
end
return redis.error_reply('unknown dispatch command ' .. tostring(command))
