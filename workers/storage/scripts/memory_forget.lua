-- Delete memory partitions of one user with every key they have (records, closed, vectors, meta,
-- pending turns, flags): forgetting everything about a user (`all`), or retention deleting one idle
-- partition (`idle_before`). One slot: every key has the user's hash tag.
-- KEYS[1] the user's partitions (set of suffixes)   KEYS[2..] every key of the partitions named
-- ARGV[1] JSON {suffixes: [suffix], all: bool, idle_before: number|null, meta: index into KEYS of
--               the partition's meta hash (with idle_before)}
-- Returns the number of keys deleted; -1 when `all` and the user has a partition not in `suffixes`
-- (one was added since they were read: read again); -2 when `idle_before` and the partition was
-- written since (nothing deleted)

local a = cjson.decode(ARGV[1])
if a.all then
  local named = {}
  for _, s in ipairs(a.suffixes) do named[s] = true end
  for _, s in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    if not named[s] then return -1 end
  end
end
if a.idle_before and a.idle_before ~= cjson.null then
  local updated = tonumber(redis.call('HGET', KEYS[a.meta], 'updated_at') or '0')
  if updated > a.idle_before then return -2 end
end
local deleted = 0
for i = 2, #KEYS do deleted = deleted + redis.call('DEL', KEYS[i]) end
if a.all then
  deleted = deleted + redis.call('DEL', KEYS[1])
else
  for _, s in ipairs(a.suffixes) do redis.call('SREM', KEYS[1], s) end
end
return deleted
