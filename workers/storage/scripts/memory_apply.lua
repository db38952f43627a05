-- Apply one consolidation to a user's memory partition (pipeline/consolidation.py decided it):
-- new and closed records written by id, forgotten ones deleted with every trace, the fact index kept
-- equal to the current facts, the closed ones trimmed, and the turns it consolidated marked done. Guarded
-- by the revision the caller read: if another write moved it, nothing is written (read again and
-- consolidate again). All keys share the hash tag `{<tenant>/<user>}`: one slot.
-- KEYS[1] records (hash id -> current record JSON)   KEYS[2] facts (hash key -> current id)
-- KEYS[3] closed (hash id -> closed record JSON)    KEYS[4] history_order (zset id by invalid_at)
-- KEYS[5] vectors (hash note id -> packed float32)   KEYS[6] meta (hash)
-- KEYS[7] turns (zset of consolidated turn ids)      KEYS[8] pending (hash turn id -> turn JSON)
-- KEYS[9] the user's partitions (set of suffixes)
-- ARGV[1] JSON {revision, now, suffix, meta: {tenant_id, user_id, app_id, agent_id, partition},
--               max_history, turns_kept, turn_ids, unpend, deletes: [id],
--               writes: [{id, kind, key, current, invalid_at, vector}]}
-- ARGV[2..] each write's record JSON, in order; then the packed vector of each write with `vector`
-- Returns {1, revision} applied (the new revision, or the same when nothing changed);
-- {0, revision} the revision moved (nothing written); {-1, revision} a turn of `turn_ids` is no
-- longer pending (a forget removed it meanwhile: nothing written)

local a = cjson.decode(ARGV[1])
local records, facts, closed, order, vectors, meta, turns, pending, partitions =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local revision = tonumber(redis.call('HGET', meta, 'revision') or '0')
if revision ~= a.revision then return {0, revision} end
for _, id in ipairs(a.turn_ids) do
  if redis.call('HEXISTS', pending, id) == 0 then return {-1, revision} end
end

local function unindex(key, id)
  if key and key ~= cjson.null and redis.call('HGET', facts, key) == id then redis.call('HDEL', facts, key) end
end

for _, id in ipairs(a.deletes) do
  local stored = redis.call('HGET', records, id) or redis.call('HGET', closed, id)
  if stored then unindex(cjson.decode(stored).key, id) end
  redis.call('HDEL', records, id)
  redis.call('HDEL', closed, id)
  redis.call('ZREM', order, id)
  redis.call('HDEL', vectors, id)
end

local blob = 2 + #a.writes
for i, w in ipairs(a.writes) do
  local json = ARGV[1 + i]
  if w.current then
    redis.call('HSET', records, w.id, json)
    redis.call('HDEL', closed, w.id)
    redis.call('ZREM', order, w.id)
    if w.kind == 'fact' then redis.call('HSET', facts, w.key, w.id) end
  else
    redis.call('HDEL', records, w.id)
    redis.call('HSET', closed, w.id, json)
    redis.call('ZADD', order, string.format('%.6f', w.invalid_at), w.id)
    if w.kind == 'fact' then unindex(w.key, w.id) end
  end
  if w.vector then
    redis.call('HSET', vectors, w.id, ARGV[blob])
    blob = blob + 1
  else
    redis.call('HDEL', vectors, w.id)
  end
end

local extra = redis.call('ZCARD', order) - a.max_history
if extra > 0 then
  local oldest = redis.call('ZRANGE', order, 0, extra - 1)
  redis.call('HDEL', closed, unpack(oldest))
  redis.call('HDEL', vectors, unpack(oldest))
  redis.call('ZREM', order, unpack(oldest))
end

for _, id in ipairs(a.turn_ids) do
  redis.call('ZADD', turns, string.format('%.6f', a.now), id)
  redis.call('HDEL', pending, id)
end
for _, id in ipairs(a.unpend) do redis.call('HDEL', pending, id) end
if #a.turn_ids > 0 then redis.call('ZREMRANGEBYRANK', turns, 0, -(a.turns_kept + 1)) end

if #a.writes == 0 and #a.deletes == 0 then return {1, revision} end
-- never a revision used before, even after a forget deleted the meta hash: the server's clock in
-- ms when it is ahead (so a reader of the old partition cannot mistake the new one for it)
local t = redis.call('TIME')
local next_revision = math.max(revision + 1, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('HSET', meta, 'revision', string.format('%.0f', next_revision), 'updated_at', string.format('%.6f', a.now),
           'tenant_id', a.meta.tenant_id, 'user_id', a.meta.user_id, 'app_id', a.meta.app_id,
           'agent_id', a.meta.agent_id, 'partition', a.meta.partition)
redis.call('SADD', partitions, a.suffix)
return {1, next_revision}
