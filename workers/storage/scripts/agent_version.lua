-- A config document becomes the agent's next immutable version and its active one, unless it is
-- the active version's document (same digest): then nothing changes. The caller numbers the new
-- version (`latest` + 1, as it read it) and the script refuses when `latest` moved meanwhile, so
-- concurrent puts of one document make one version and no number is ever written twice; the
-- caller reads again and retries. The agent's hash keeps the active version's document too
-- (`active_config`): a turn reads the active config in one command.
-- KEYS[1] the agent (hash: active, latest, active_config)   KEYS[2] its versions' metadata (hash: number -> JSON)
-- KEYS[3] its activations (list, newest first)   KEYS[4] the set of agents (the sharded layout: the
--   agent again, with `index` false: the caller added it, the set is in another slot)   KEYS[5] the new version
-- ARGV[1] JSON {agent_id, version (string), digest, index}   ARGV[2] the new version's metadata (JSON)
-- ARGV[3] its activation (JSON)   ARGV[4] the config (canonical JSON)
-- Returns {'unchanged', active} | {'conflict', latest} | {'created', version}
local a = cjson.decode(ARGV[1])
local agent = redis.call('HMGET', KEYS[1], 'active', 'latest')
local active, latest = agent[1], agent[2] or '0'
if active then
  local meta = redis.call('HGET', KEYS[2], active)
  if meta and cjson.decode(meta).digest == a.digest then
    -- an agent made active before its hash kept the document gets it now
    redis.call('HSETNX', KEYS[1], 'active_config', ARGV[4])
    return {'unchanged', active}
  end
end
if tonumber(latest) + 1 ~= tonumber(a.version) or redis.call('EXISTS', KEYS[5]) == 1 then
  return {'conflict', latest}
end
redis.call('SET', KEYS[5], ARGV[4])
redis.call('HSET', KEYS[2], a.version, ARGV[2])
redis.call('HSET', KEYS[1], 'active', a.version, 'latest', a.version, 'active_config', ARGV[4])
redis.call('LPUSH', KEYS[3], ARGV[3])
redis.call('LTRIM', KEYS[3], 0, 999)
if a.index then redis.call('SADD', KEYS[4], a.agent_id) end
return {'created', a.version}
