-- Append one event to a live turn's stream (text deltas, tool calls and results).
-- KEYS[1] turn   KEYS[2] events   ARGV[1] the event, without seq
-- Returns its seq, or 0 when the turn has ended
local status = redis.call('HGET', KEYS[1], 'status')
if status and TERMINAL[status] then return 0 end
return emit(KEYS[1], KEYS[2], ARGV[1])
