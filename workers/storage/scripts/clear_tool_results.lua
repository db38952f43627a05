-- Compaction's clearing of old tool results: turns' snapshots replaced, each with its content version
-- bumped and its token count under the new version, all or nothing; only while no turn of the
-- conversation holds it, while the conversation exists, and while every snapshot and version is the
-- one read (the field names are computed by the caller: storage/conversations.py).
-- KEYS[1] conversation   KEYS[2] lease   KEYS[3] snapshots   KEYS[4] token counts
-- ARGV[1] JSON {turns: [{id, version_field, version, old_count, new_count, count}]}
-- ARGV[2 * i], ARGV[2 * i + 1]: turn i's snapshot as read, and cleared
-- Returns 'cleared' | 'gone' | 'busy' | 'changed'
local a = cjson.decode(ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return 'gone' end
if redis.call('HEXISTS', KEYS[2], 'turn') == 1 then return 'busy' end
for i, t in ipairs(a.turns) do
  local version = tonumber(redis.call('HGET', KEYS[4], t.version_field) or '0')
  if redis.call('HGET', KEYS[3], t.id) ~= ARGV[2 * i] or version ~= t.version then return 'changed' end
end
for i, t in ipairs(a.turns) do
  redis.call('HSET', KEYS[3], t.id, ARGV[2 * i + 1])
  redis.call('HDEL', KEYS[4], t.old_count)
  redis.call('HSET', KEYS[4], t.version_field, t.version + 1, t.new_count, t.count)
end
return 'cleared'
