"""The session store's Lua scripts: create, read, lock-and-read, save-and-unlock, renew.

Each runs atomically in Redis, so a session's record, its segment log, its held Samples, the
idle index and the Sample stream change together or not at all (store.py calls them).
"""

from flywheel.core.streams import BACKLOG_LUA
from flywheel.gateway.session.script_deadline import NOW_LUA

CREATE_LUA = """
if not redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2], 'NX') then return 0 end
redis.call('DEL', KEYS[3], KEYS[4])
if ARGV[5] ~= '' then
  redis.call('RPUSH', KEYS[3], ARGV[5])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
return 1
"""
"""Store a new session's record (head ARGV[1], log chunk ARGV[5]) unless the id is taken (0),
and index it as touched now (a log or held list left by an earlier session of the id goes)."""

READ_LUA = """
return {redis.call('GET', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1)}
"""
"""A session's record head and log (segment_log.py), read together."""

TAKE_LUA = (
    NOW_LUA
    + """
local now = now_ms()
if ARGV[4] ~= '0' and now > tonumber(ARGV[4]) then return {4, now} end
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, now} end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {2, now} end
local head = ARGV[3]
if head ~= '' and redis.call('GETRANGE', KEYS[1], 0, #head - 1) == head then return {3, now} end
return {1, now, redis.call('GET', KEYS[1]), redis.call('LRANGE', KEYS[3], 0, -1)}
"""
)
"""Lock a session and read its record: {0} no session, {1, head, log} taken, {2} busy, {3} taken
and the stored record starts with ARGV[3] (the caller's cached rev: it holds the record), {4}
past the deadline ARGV[4] (nothing done); each with Redis's time (ms) second."""

PUT_LUA = (
    BACKLOG_LUA
    + NOW_LUA
    + """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if late(ARGV[11]) then
  redis.call('DEL', KEYS[2])
  return 3
end
if ARGV[4] == '1' then
  if ARGV[12] ~= '1' and (redis.call('LLEN', KEYS[5]) ~= tonumber(ARGV[14])
                         or redis.call('EXISTS', KEYS[1]) == 0) then
    return 4
  end
  local high_water = tonumber(ARGV[9])
  local first = 17 + tonumber(ARGV[15])
  if #ARGV >= first and high_water > 0 and backlog(KEYS[4], ARGV[10]) >= high_water then
    redis.call('DEL', KEYS[2])
    return 2
  end
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  if ARGV[12] == '1' then redis.call('DEL', KEYS[5]) end
  if ARGV[13] ~= '' then redis.call('RPUSH', KEYS[5], ARGV[13]) end
  redis.call('EXPIRE', KEYS[5], ARGV[3])
  if ARGV[5] == 'open' then redis.call('ZADD', KEYS[3], ARGV[7], ARGV[6])
  else redis.call('ZREM', KEYS[3], ARGV[6]) end
  if ARGV[16] == '1' then redis.call('DEL', KEYS[6]) end
  for i = 17, first - 1 do redis.call('RPUSH', KEYS[6], ARGV[i]) end
  if redis.call('EXISTS', KEYS[6]) == 1 then redis.call('EXPIRE', KEYS[6], ARGV[3]) end
  for i = first, #ARGV do redis.call('XADD', KEYS[4], '*', ARGV[8], ARGV[i]) end
end
redis.call('DEL', KEYS[2])
return 1
"""
)
"""Save the record (head ARGV[2]; its log KEYS[5] rewritten when ARGV[12] is 1, chunk ARGV[13]
appended) and its last-touch time in the idle index and add its queued Samples to
the stream KEYS[4] (when ARGV[4] is 1), then unlock; all only while the lock is still ours
(else 0). With Samples queued and the stream's backlog at its high-water mark ARGV[9] (watched
group ARGV[10]) nothing is written and the lock released (2): the turn is refused whole. Past
the deadline ARGV[11] (script_deadline.py) only the lock is released (3). An append to a log
that no longer holds ARGV[14] chunks, or to an expired record, writes nothing and keeps the lock
(4): the caller saves the record whole instead. Held Samples (episode mode, until the finish):
ARGV[15] of them, ARGV[17..], appended to the held list KEYS[6] after emptying it when ARGV[16]
is 1; the stream's Samples follow them."""

RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
