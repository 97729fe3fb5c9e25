-- The Rate Limit Quota Service's demand board: one replica records one Envoy's demand for one
-- quota bucket, and gets back every live Envoy's demand for it, atomically, so that every
-- replica splits the bucket's limit over the same list.
--
-- KEYS[1]: the bucket's hash, one field per Envoy stream (`<replica>-<stream>`), each valued
--          "<expiry ms on Redis's clock> <demand in requests per second, or inf>".
-- ARGV[1]: the stream; ARGV[2]: its demand ("" removes it: the stream ended; "?" only reads);
-- ARGV[3]: how long the entry lives without a new report, in milliseconds;
-- ARGV[4]: the channel a material change is published on ("<stream> <key>"), so the bucket's
--          other holders on every replica recompute at once;
-- ARGV[5]: the fraction a demand must move by to be material.
-- Returns a flat list: stream, demand, stream, demand, ... of the entries still live.
local key, member, demand, ttl = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local changed = false
if demand ~= '?' then
  local old = redis.call('HGET', key, member)
  if old then
    old = string.sub(old, (string.find(old, ' ', 1, true) or #old) + 1)
  end
  if demand == '' then
    redis.call('HDEL', key, member)
    changed = old ~= false and old ~= nil
  else
    redis.call('HSET', key, member, (now + ttl) .. ' ' .. demand)
    if not old then
      changed = true
    elseif old ~= demand then
      local a, b = tonumber(old), tonumber(demand)
      if old == 'inf' or demand == 'inf' or a == nil or b == nil then
        changed = true
      else
        changed = math.abs(b - a) > tonumber(ARGV[5]) * math.max(a, b)
      end
    end
  end
end
local all = redis.call('HGETALL', key)
local live = {}
local longest = 0
for i = 1, #all, 2 do
  local value = all[i + 1]
  local space = string.find(value, ' ', 1, true)
  local expires = space and tonumber(string.sub(value, 1, space - 1))
  if expires == nil or expires <= now then
    redis.call('HDEL', key, all[i])
    changed = true
  else
    live[#live + 1] = all[i]
    live[#live + 1] = string.sub(value, space + 1)
    if expires - now > longest then
      longest = expires - now
    end
  end
end
if longest > 0 then
  redis.call('PEXPIRE', key, longest)
end
if changed then
  redis.call('PUBLISH', ARGV[4], member .. ' ' .. key)
end
return live
