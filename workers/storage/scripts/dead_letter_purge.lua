-- Delete a queue's dead letters dead-lettered at or before a time: their entries and their bodies.
-- KEYS[1] `<queue>.XQ`   KEYS[2] `<queue>.XQ.msgs`
-- ARGV[1] the cutoff in ms ("+inf": every dead letter, and any body left without its entry)
-- Returns how many entries were deleted
if ARGV[1] == '+inf' then
  local count = redis.call('ZCARD', KEYS[1])
  redis.call('DEL', KEYS[1], KEYS[2])
  return count
end
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
end
return #ids
