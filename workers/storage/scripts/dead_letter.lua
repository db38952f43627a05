-- Dead-letter messages a consumer refused (undecodable, too deep, malformed, unknown actor), and
-- with `sweep` drop from the ack set the ids whose body is missing (dispatch.lua `fetch` returns nil
-- for them and leaves them in the ack set). A refused body is found among the ack set's bodies by
-- comparison, not by the id it claims, which may be missing, unreadable or another message's. Found
-- bodies move to dramatiq's dead-letter set as its `nack` does. Every dead-lettering appends one
-- entry to the dead-letter stream.
-- KEYS[1] this consumer's ack set   KEYS[2] the queue's bodies (`<queue>.msgs`)   KEYS[3] `<queue>.XQ`
-- KEYS[4] `<queue>.XQ.msgs`   KEYS[5] the dead-letter stream
-- ARGV[1] now (ms)   ARGV[2] queue   ARGV[3] the stream's MAXLEN   ARGV[4] sweep ("1"/"0")
-- ARGV[5...] (body, reason, actor) per refused message
-- Returns a flat list: redis id ("" when the body was not found), reason; swept ids first
local acks, msgs, xq, xq_msgs, stream = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now, queue, maxlen, sweep = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == "1"
local out = {}
local function record(id, actor, reason)
  redis.call("xadd", stream, "MAXLEN", "~", maxlen, "*",
             "queue", queue, "message_id", id, "actor", actor, "reason", reason)
  table.insert(out, id)
  table.insert(out, reason)
end
local ids = redis.call("smembers", acks)
local sizes = {}
for i, id in ipairs(ids) do
  if redis.call("hexists", msgs, id) == 1 then
    sizes[i] = redis.call("hstrlen", msgs, id)
  elseif sweep then
    redis.call("srem", acks, id)
    record(id, "", "missing_body")
  end
end
for j = 5, #ARGV, 3 do
  local body, reason, actor = ARGV[j], ARGV[j + 1], ARGV[j + 2]
  local found = ""
  for i, id in ipairs(ids) do
    if sizes[i] == #body and redis.call("hget", msgs, id) == body then
      sizes[i] = -1
      redis.call("srem", acks, id)
      redis.call("zadd", xq, now, id)
      redis.call("hset", xq_msgs, id, body)
      redis.call("hdel", msgs, id)
      found = id
      break
    end
  end
  record(found, actor, reason)
end
return out
