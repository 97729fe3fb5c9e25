-- rlsd: decide requests atomically, each all or nothing. A Lua mirror of src/algorithm.rs: the
-- same formulas in the same order, so both stores give bit-identical answers.
--
-- One call carries one or more requests (rlsd coalesces concurrent requests into one call);
-- they are decided in order, each seeing what the earlier ones committed.
--
-- ARGV[1]   now in microseconds, or "" to read Redis TIME (the only clock replicas share;
--           tests pass a fixed value)
-- ARGV[2]   number of distinct limits M in this call, then 5 values per limit: algorithm
--           (fw|swlc|swc|tb|gcra), limit L, period P (µs), burst B, mode (0 enforced, 1 shadow,
--           2 quota: the request is denied by its quota checks only when none of them allows)
-- then      number of requests R, then per request: its number of checks n, its deadline (µs on
--           the script's clock, "" for none: a request the script reaches after it is answered
--           as late and writes nothing, since its caller has stopped waiting), then 2 values per
--           check: the index of its limit (1..M) and its hits: "<n>" takes n, "p" peeks (decided
--           as one hit, nothing taken), "r<n>" refunds n, "c<n>" charges n (decided as taking n,
--           and recorded whatever the answer: work already done), "d<n>" evaluates a charge as
--           "c<n>" does but records it only if the request is allowed (a dry run's)
-- then      optionally, the expiry jitter: milliseconds added to the TTL of every key this
--           call writes (EXPIRATION_JITTER_MAX_SECONDS: the caller draws it, 0..N s, per call),
--           so keys of one window do not all expire at once; answers never see it (a fixed
--           window's key that already holds the window keeps the expiry, jitter included, that
--           the window's first write gave it)
-- KEYS      the state key of every check, request after request (a key may repeat within a
--           request: the later check sees the earlier's hits)
-- Reply: one string of decimal integers separated by spaces: the script's clock (µs), then three
-- per check (allowed 0/1, or 2 for every check of a late request; remaining; reset µs), request
-- after request: one bulk string parses far faster on the
-- client than an array of 3 integers per check. A request writes
-- state only if every non-shadow check allows; when it is denied, its allowed checks report the
-- remaining they still have (nothing was taken). A string key is written once per call, with
-- its final state; a sliding log's deltas are written after each request.
--
-- Written for Redis's Lua 5.1 interpreter, where a check costs little next to the call itself
-- only if it allocates and converts little: limits are parsed once per call, every string key
-- is read by one MGET, per-key state lives in arrays indexed by the key's slot, no table is
-- built per check beyond its new state, and the usual arguments ("1" hit, a limit's index)
-- are matched as strings rather than converted.

local SLACK = 1000000
-- The most debt a charge leaves a token bucket or GCRA: ten years to drain (as in Rust).
local MAX_DEBT = 10 * 365 * 86400 * 1000000
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min

-- Integer division of non-negative integers, immune to float rounding near a multiple.
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- `idiv(us + 999, 1000) * 1000`, with idiv's body written out: one call instead of two.
local function round_up_ms(us)
  local a = us + 999
  local q = floor(a / 1000)
  if q * 1000 > a then
    q = q - 1
  elseif (q + 1) * 1000 <= a then
    q = q + 1
  end
  return q * 1000
end

local match = string.match

local function fmt(x)
  return string.format('%.17g', x)
end

-- Loading state ---------------------------------------------------------------------------

-- A sliding log is a sorted set with one member per request that took hits, scored by its
-- timestamp and named `<cum>:<count>`: its own hits, and the running total of hits up to and
-- including it. Hits in the window are then the newest total less the total before the first
-- live member, and the k-th oldest live hit is found by a binary search on the totals: every
-- operation reads O(log n) members, however many hits a request takes.
local function parse_member(member)
  local cum, count = match(member, '^(%d+):(%d+)$')
  return cum + 0, count + 0
end

-- A sliding log, read from its sorted set: what Redis holds (`stored` live hits, the newest
-- member, the total `base` before the first live hit), plus hits added or removed earlier in
-- this request and not yet written.
local function load_log(key, now, p)
  local horizon = now - p
  local st = { key = key, horizon = horizon, adds = {}, removed = 0, stored = 0, base = 0,
               expired = 0, members = 0 }
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if newest[1] then
    local cum, count = parse_member(newest[1])
    st.newest, st.newest_cum = tonumber(newest[2]), cum
    st.members = redis.call('ZCARD', key)
    st.expired = redis.call('ZCOUNT', key, '-inf', fmt(horizon))
    st.base = cum
    if st.expired < st.members then
      local first = redis.call('ZRANGE', key, st.expired, st.expired)
      local first_cum, first_count = parse_member(first[1])
      st.base = first_cum - first_count
      st.stored = cum - st.base
    end
  end
  return st
end

-- The first live member whose running total reaches `target`: its rank, timestamp, total,
-- own hits and name.
local function member_at(st, target)
  local lo, hi = st.expired, st.members - 1
  while lo < hi do
    local mid = floor((lo + hi) / 2)
    local cum = parse_member(redis.call('ZRANGE', st.key, mid, mid)[1])
    if cum >= target then
      hi = mid
    else
      lo = mid + 1
    end
  end
  local member = redis.call('ZRANGE', st.key, lo, lo, 'WITHSCORES')
  local cum, count = parse_member(member[1])
  return lo, tonumber(member[2]), cum, count, member[1]
end

-- The state in a string key's value (false when the key does not exist). Numbers are read
-- as `text + 0`: one conversion, where Lua 5.1's tonumber converts twice (a check and a read).
local function parse(alg, raw)
  if not raw then
    return false
  end
  if alg == 'gcra' then
    return { tat = raw + 0 }
  elseif alg == 'fw' then
    local window, count = match(raw, '^(%S+) (%S+)')
    return { window = window + 0, count = count + 0 }
  elseif alg == 'swc' then
    local window, current, previous = match(raw, '^(%S+) (%S+) (%S+)')
    return { window = window + 0, current = current + 0, previous = previous + 0 }
  else
    local tokens, updated = match(raw, '^(%S+) (%S+)')
    return { tokens = tokens + 0, updated = updated + 0 }
  end
end

-- The algorithms: each returns allowed, remaining, reset, new state (or nil), ttl; `force`
-- (a charge) returns the state with `take` taken even when denied ----------------------------

-- The fixed window in force at `now` and its count.
local function fixed_window_now(c, st, now)
  local window = idiv(now, c.p)
  if st and st.window >= window then
    return st.window, st.count
  end
  return window, 0
end

local function fixed_window(c, st, now, want, take, force)
  local l, p = c.l, c.p
  local window, count = fixed_window_now(c, st, now)
  local reset = max(0, (window + 1) * p - now)
  if count + want <= l then
    count = count + take
    return true, l - count, reset, { window = window, count = count }, reset + SLACK
  end
  if force then
    return false, max(0, l - count), reset, { window = window, count = count + take }, reset + SLACK
  end
  return false, max(0, l - count), reset
end

-- Hits in the window: what Redis holds, less what this request gave back, plus what it added.
local function log_live(st)
  local n = st.stored - st.removed
  for _, add in ipairs(st.adds) do
    n = n + add.count
  end
  return n
end

local function log_newest(st)
  local last = st.adds[#st.adds]
  if last then
    return last.ts
  end
  if st.removed > 0 then
    local target = st.newest_cum - st.removed
    if target > st.base then
      local _, ts = member_at(st, target)
      return ts
    end
    -- Every live hit given back: the newest expired member, if any.
    if st.expired > 0 then
      local member = redis.call('ZRANGE', st.key, st.expired - 1, st.expired - 1, 'WITHSCORES')
      return tonumber(member[2])
    end
    return nil
  end
  return st.newest
end

local function log_nth_oldest_ts(st, k)
  local stored = st.stored - st.removed
  if k <= stored then
    local _, ts = member_at(st, st.base + k)
    return ts
  end
  k = k - stored
  for _, add in ipairs(st.adds) do
    if add.count >= k then
      return add.ts
    end
    k = k - add.count
  end
  return log_newest(st)
end

local function copy_log(st)
  local adds = {}
  for i, add in ipairs(st.adds) do
    adds[i] = { ts = add.ts, count = add.count }
  end
  return { key = st.key, horizon = st.horizon, stored = st.stored, removed = st.removed,
           newest = st.newest, newest_cum = st.newest_cum, base = st.base, expired = st.expired,
           members = st.members, adds = adds }
end

-- The log with `take` hits added at now (never before its newest), and its time to live.
local function log_taken(st, now, p, take)
  local newest = log_newest(st)
  local at = newest and max(newest, now) or now
  local new = copy_log(st)
  if take > 0 then
    local last = new.adds[#new.adds]
    if last and last.ts == at then
      last.count = last.count + take
    else
      new.adds[#new.adds + 1] = { ts = at, count = take }
    end
  end
  local live_newest = log_newest(new)
  -- State ahead of a clock that stepped back lives as long as it matters.
  local ahead = 0
  if live_newest then
    ahead = max(0, live_newest - now)
  end
  return new, p + SLACK + ahead, live_newest
end

local function sliding_log(c, st, now, want, take, force)
  local l, p = c.l, c.p
  local n = log_live(st)
  if n + want <= l then
    local new, ttl, live_newest = log_taken(st, now, p, take)
    local reset = 0
    if live_newest and (now < p or live_newest > now - p) then
      reset = max(0, live_newest + p - now)
    end
    return true, l - n - take, reset, new, ttl
  end
  -- None when the log holds fewer hits than needed (a charge larger than the limit).
  local ts = log_nth_oldest_ts(st, n + want - l)
  local reset = ts and max(0, ts + p - now) or 0
  if force then
    local new, ttl = log_taken(st, now, p, take)
    return false, max(0, l - n), reset, new, ttl
  end
  return false, max(0, l - n), reset
end

local function sliding_counter_wait(l, p, now, window, current, previous, want)
  local pf = p
  local function solve(count, base)
    local room = l - base
    if room < 0 then
      return nil
    end
    if count == 0 then
      return 0
    end
    return max(0, pf - room * pf / count)
  end
  local e = solve(previous, current + want)
  if e and e < pf then
    return max(0, window * p + ceil(e) - now)
  end
  e = solve(current, want)
  if e and e < pf then
    return max(0, (window + 1) * p + ceil(e) - now)
  end
  return (window + 2) * p - now
end

-- The sliding counter rolled forward to `now`: the instant used, the current window, and its
-- current and previous counts.
local function sliding_now(c, st, now)
  local window = idiv(now, c.p)
  if st then
    if st.window >= window then
      return max(now, st.window * c.p), st.window, st.current, st.previous
    elseif st.window + 1 == window then
      return now, window, 0, st.current
    end
  end
  return now, window, 0, 0
end

local function sliding_counter(c, st, clock_now, want, take, force)
  local l, p = c.l, c.p
  local now, window, current, previous = sliding_now(c, st, clock_now)
  local elapsed = now - window * p
  local weight = (p - elapsed) / p
  local estimate = previous * weight + current
  local window_end = (window + 1) * p
  if estimate + want <= l then
    current = current + take
    local reset = 0
    if current > 0 then
      reset = window_end + p - now
    elseif previous > 0 then
      reset = window_end - now
    end
    -- Never below 0: past charges can leave the estimate a hair over L - take in floats.
    return true, max(0, floor(l - estimate - take)), reset,
      { window = window, current = current, previous = previous }, 2 * p + SLACK + (now - clock_now)
  end
  local reset = max(1, sliding_counter_wait(l, p, now, window, current, previous, want))
  if force then
    return false, floor(max(0, l - estimate)), reset,
      { window = window, current = current + take, previous = previous }, 2 * p + SLACK + (now - clock_now)
  end
  return false, floor(max(0, l - estimate)), reset
end

local function refilled_bucket(c, st, now)
  if st then
    local elapsed = max(0, now - st.updated)
    local refill = elapsed * c.l / c.p
    return min(c.b, st.tokens + refill), max(now, st.updated)
  end
  return c.b, now
end

local function bucket_ttl(c, tokens)
  local missing = max(0, c.b - tokens)
  return ceil(missing * c.p / c.l) + SLACK
end

local function token_bucket(c, st, now, want, take, force)
  local tokens, updated = refilled_bucket(c, st, now)
  local rate_inverse = c.p / c.l
  if tokens >= want then
    tokens = tokens - take
    local missing = max(0, c.b - tokens)
    return true, floor(tokens), ceil(missing * rate_inverse),
      { tokens = tokens, updated = updated }, bucket_ttl(c, tokens) + max(0, updated - now)
  end
  local remaining, reset = floor(max(0, tokens)), ceil((want - tokens) * rate_inverse)
  if force then
    -- A charge leaves the bucket in debt (negative tokens), at most MAX_DEBT to refill.
    local owed = min(tokens, max(tokens - take, c.b - MAX_DEBT * c.l / c.p))
    return false, remaining, reset, { tokens = owed, updated = updated },
      bucket_ttl(c, owed) + max(0, updated - now)
  end
  return false, remaining, reset
end

local function emission_interval(c)
  return max(1, idiv(c.p, max(c.l, 1)))
end

local function gcra(c, st, now, want, take, force)
  local t, tau = c.t, c.tau
  local tat0 = now
  if st and st.tat > now then
    tat0 = st.tat
  end
  local horizon = now + tau + t
  if horizon >= tat0 + want * t then
    local new_tat = tat0 + take * t
    return true, idiv(horizon - new_tat, t), new_tat - now, { tat = new_tat }, new_tat - now + SLACK
  end
  local allow_at = tat0 + want * t - tau - t
  local remaining = idiv(max(0, horizon - tat0), t)
  if force then
    -- A charge moves the arrival time on as debt, at most MAX_DEBT ahead.
    local owed = max(tat0, min(tat0 + take * t, now + MAX_DEBT))
    return false, min(remaining, c.b), allow_at - now, { tat = owed }, owed - now + SLACK
  end
  return false, min(remaining, c.b), allow_at - now
end

local ALGORITHMS = { fw = fixed_window, swlc = sliding_log, swc = sliding_counter, tb = token_bucket, gcra = gcra }

-- Refunds ----------------------------------------------------------------------------------

local function refunded(c, st, now, n)
  local p = c.p
  if c.alg == 'fw' then
    local window, count = fixed_window_now(c, st, now)
    return { window = window, count = max(0, count - n) }, max(0, (window + 1) * p - now) + SLACK
  elseif c.alg == 'swlc' then
    local new = copy_log(st)
    local left = n
    while left > 0 and #new.adds > 0 do
      local last = new.adds[#new.adds]
      local give = min(last.count, left)
      last.count = last.count - give
      left = left - give
      if last.count == 0 then
        new.adds[#new.adds] = nil
      end
    end
    new.removed = min(new.stored, new.removed + left)
    local newest = log_newest(new)
    local ahead = 0
    if newest then
      ahead = max(0, newest - now)
    end
    return new, p + SLACK + ahead
  elseif c.alg == 'swc' then
    local at, window, current, previous = sliding_now(c, st, now)
    return { window = window, current = max(0, current - n), previous = previous }, 2 * p + SLACK + (at - now)
  elseif c.alg == 'tb' then
    local tokens, updated = refilled_bucket(c, st, now)
    tokens = min(tokens + n, c.b)
    return { tokens = tokens, updated = updated }, bucket_ttl(c, tokens) + max(0, updated - now)
  else
    local tat = max(max(0, st.tat - n * c.t), now)
    return { tat = tat }, tat - now + SLACK
  end
end

-- One check --------------------------------------------------------------------------------

local function has_state(c, st)
  if c.alg == 'swlc' then
    return st.stored > 0 or #st.adds > 0
  end
  return st ~= false
end

-- One check's answer: allowed, remaining, reset (µs, rounded up to whole ms), unconsumed (the
-- remaining to report if another limit denies the request), new state (nil: nothing to
-- write) and its ttl.
local function run(c, st, now, want, take, force)
  if st == false then
    st = nil
  end
  local allowed, remaining, reset, new, ttl = c.algorithm(c, st, now, want, take, force)
  local unconsumed = remaining
  if allowed then
    unconsumed = remaining + take
  end
  if (not allowed and not force) or take == 0 then
    new = nil
  end
  return allowed, remaining, round_up_ms(reset), unconsumed, new, ttl
end

-- The reset of a request that never passes: a fixed window's end, else one period (as in Rust).
local function never_reset(c, now)
  if c.alg == 'fw' then
    return round_up_ms((idiv(now, c.p) + 1) * c.p - now)
  end
  return round_up_ms(c.p)
end

local function assess(c, mode, n, st, now)
  if c.l == 0 then
    return mode == 'r', 0, never_reset(c, now), 0
  end
  if mode == 'p' then
    return run(c, st, now, 1, 0)
  elseif mode == 'r' then
    local allowed, remaining, reset = run(c, st, now, 0, 0)
    if not has_state(c, st) then
      return allowed, remaining, reset, remaining
    end
    local new, ttl = refunded(c, st, now, n)
    local after_allowed, after_remaining, after_reset = run(c, new, now, 0, 0)
    return after_allowed, after_remaining, after_reset, remaining, new, ttl
  end
  if mode == 'c' or mode == 'd' then
    local allowed, remaining, reset, unconsumed, new, ttl = run(c, st, now, n, n, true)
    if n > c.capacity then
      local _, idle = run(c, st, now, 0, 0)
      unconsumed = idle
    elseif allowed then
      return allowed, remaining, reset, unconsumed, new, ttl
    end
    -- Recorded past the limit: it answers the state it leaves, as a check right after it would.
    local _, _, next_reset = run(c, new or st, now, 1, 0)
    return false, 0, next_reset, unconsumed, new, ttl
  end
  if n > c.capacity then
    local _, remaining = run(c, st, now, 0, 0)
    return false, remaining, never_reset(c, now), remaining
  end
  return run(c, st, now, n, n)
end

-- A usual take of `n` hits (see `decided_simply`) on a fixed window no newer than the limit's
-- current one, or on GCRA: what `assess` answers (allowed, remaining, reset in whole ms,
-- unconsumed) and the new state's one number (the window's count, or the arrival time; nil:
-- nothing to write) and TTL, computing what `fixed_window` and `gcra` compute but without a
-- state table; nil when the window is newer (a clock that stepped back).
local function fixed_window_take(c, st, n)
  local used = 0
  if st then
    if st.window > c.window then
      return nil
    elseif st.window == c.window then
      used = st.count
    end
  end
  local l = c.l
  if used + n <= l then
    return true, l - used - n, c.reset_ms, l - used, n > 0 and used + n or nil, c.ttl
  end
  local remaining = max(0, l - used)
  return false, remaining, c.reset_ms, remaining
end

local function gcra_take(c, st, n, now)
  local t = c.t
  local tat0 = now
  if st and st.tat > now then
    tat0 = st.tat
  end
  local horizon = now + c.tau + t
  if horizon >= tat0 + n * t then
    local new_tat = tat0 + n * t
    -- An interval of 1 µs (a limit of at least one hit per µs of its period) divides exactly.
    local remaining = horizon - new_tat
    if t ~= 1 then
      remaining = idiv(remaining, t)
    end
    return true, remaining, round_up_ms(new_tat - now), remaining + n,
      n > 0 and new_tat or nil, new_tat - now + SLACK
  end
  local remaining = min(idiv(max(0, horizon - tat0), t), c.b)
  return false, remaining, round_up_ms(tat0 + n * t - c.tau - t - now), remaining
end

-- Writing state ----------------------------------------------------------------------------

-- Set from the optional last argument, once the requests are parsed.
local jitter_ms = 0

-- `kept`: a fixed window's key that already holds this window, so its expiry (set by the
-- write that opened the window: the window's end plus the slack, on Redis's clock) stands.
local function store(c, key, st, ttl, now, kept)
  if kept then
    -- SET with KEEPTTL: no TTL to format, and Redis neither sets nor rewrites an expiry.
    redis.call('SET', key, string.format('%d %d', st.window, st.count), 'KEEPTTL')
    return
  end
  -- Formatted here: Redis would turn a Lua number into text with %.17g, a slower conversion.
  ttl = string.format('%d', max(1, ceil(ttl / 1000)) + jitter_ms)
  if c.alg == 'swlc' then
    -- Hits given back leave from the newest end (ranks are still those read at load).
    if st.removed > 0 then
      local target = st.newest_cum - st.removed
      if target > st.base then
        local rank, ts, cum, count, member = member_at(st, target)
        redis.call('ZREMRANGEBYRANK', key, rank + 1, -1)
        if cum > target then
          redis.call('ZREM', key, member)
          redis.call('ZADD', key, fmt(ts), string.format('%d:%d', target, count - (cum - target)))
        end
      else
        redis.call('ZREMRANGEBYRANK', key, st.expired, -1)
      end
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(st.horizon))
    local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    local newest_ts, newest_cum, newest_count, newest_member = nil, 0, 0, newest[1]
    if newest_member then
      newest_ts = tonumber(newest[2])
      newest_cum, newest_count = parse_member(newest_member)
    end
    -- One member per instant: hits at the newest member's instant join it.
    for _, add in ipairs(st.adds) do
      if newest_ts and add.ts == newest_ts then
        redis.call('ZREM', key, newest_member)
        newest_count = newest_count + add.count
      else
        newest_count = add.count
      end
      newest_cum = newest_cum + add.count
      newest_ts = add.ts
      newest_member = string.format('%d:%d', newest_cum, newest_count)
      redis.call('ZADD', key, fmt(add.ts), newest_member)
    end
    redis.call('PEXPIRE', key, ttl)
  elseif c.alg == 'fw' then
    redis.call('SET', key, string.format('%d %d', st.window, st.count), 'PX', ttl)
  elseif c.alg == 'swc' then
    redis.call('SET', key, string.format('%d %d %d', st.window, st.current, st.previous), 'PX', ttl)
  elseif c.alg == 'tb' then
    redis.call('SET', key, fmt(st.tokens) .. ' ' .. string.format('%d', st.updated), 'PX', ttl)
  else
    redis.call('SET', key, string.format('%d', st.tat), 'PX', ttl)
  end
end

-- Entry ------------------------------------------------------------------------------------

local now
if ARGV[1] ~= '' then
  now = ARGV[1] + 0
else
  local time = redis.call('TIME')
  now = time[1] * 1000000 + time[2]
end

-- Limits, each also under the text checks name it by ("1", "2", ...), so naming one costs a
-- table lookup instead of a number conversion.
local limit_named = {}
local TAKES = { fw = fixed_window_take, gcra = gcra_take }
local limit_count = ARGV[2] + 0
for i = 1, limit_count do
  local a = 3 + 5 * (i - 1)
  local alg = ARGV[a]
  local c = { alg = alg, algorithm = ALGORITHMS[alg], l = ARGV[a + 1] + 0,
              p = ARGV[a + 2] + 0, b = ARGV[a + 3] + 0, shadow = ARGV[a + 4] == '1',
              quota = ARGV[a + 4] == '2' }
  if alg == 'tb' or alg == 'gcra' then
    c.capacity = c.b
  else
    c.capacity = c.l
  end
  if alg == 'gcra' then
    c.t = emission_interval(c)
    c.tau = max(0, c.b - 1) * c.t
  end
  -- A fixed window's window, reset and TTL at `now` are the same for every check of the
  -- limit: computed once here for the usual check (see `fixed_window_take`).
  if alg == 'fw' and c.l ~= 0 then
    c.window = idiv(now, c.p)
    c.reset_us = max(0, (c.window + 1) * c.p - now)
    c.reset_ms, c.ttl = round_up_ms(c.reset_us), c.reset_us + SLACK
  end
  -- How `decided_simply` decides a take on this limit, if it can (not in quota mode, L > 0).
  if c.l ~= 0 and not c.quota then
    c.take = TAKES[alg]
  end
  limit_named[string.format('%d', i)] = c
end
local first_request_arg = 3 + 5 * limit_count
local request_count = ARGV[first_request_arg] + 0

-- Pass 1: each request's number of checks, each check's limit and key slot, and every string
-- key read at once (sorted-set logs are read as they come). L = 0 denies without reading
-- anything. Per-key state lives in arrays indexed by slot: one string lookup per check.
local count_of, limit_of, slot_of_check = {}, {}, {}
local slot_of, key_at, slots = {}, {}, 0
local fetch, fetch_slot, fetched, fetches = {}, {}, {}, 0
do
  local g, arg = 1, first_request_arg + 1
  for r = 1, request_count do
    local count = ARGV[arg] + 0
    count_of[r] = count
    arg = arg + 2
    for _ = 1, count do
      local c = limit_named[ARGV[arg]]
      local key = KEYS[g]
      local s = slot_of[key]
      if not s then
        slots = slots + 1
        s = slots
        slot_of[key], key_at[s] = s, key
      end
      limit_of[g], slot_of_check[g] = c, s
      if c.alg ~= 'swlc' and c.l ~= 0 and not fetched[s] then
        fetched[s] = true
        fetches = fetches + 1
        fetch[fetches], fetch_slot[fetches] = key, s
      end
      g, arg = g + 1, arg + 2
    end
  end
  if ARGV[arg] then
    jitter_ms = ARGV[arg] + 0
  end
end
local raw_at = {}
-- In chunks: Lua's unpack has a stack limit (about 8000 values).
for from = 1, fetches, 1000 do
  local to = min(from + 999, fetches)
  local values = redis.call('MGET', unpack(fetch, from, to))
  for i = from, to do
    raw_at[fetch_slot[i]] = values[i - from + 1]
  end
end

-- Committed state of each slot so far in this call (false: none). Sliding logs are dropped
-- after a write and read again, since their writes are deltas. `pending_at` holds the state a
-- request has built but not yet written, tagged with the request in `pending_in`.
local loaded_at, pending_at, pending_in, written_in = {}, {}, {}, {}
-- The window a fixed window's key held when the call began, if it held one.
local window_in_redis = {}
local allowed_of, remaining_of, unconsumed_of, reset_of, state_of, ttl_of = {}, {}, {}, {}, {}, {}
local charged_of, charge_of = {}, {}
-- A string key's state is written once per call, after the last request: the call is atomic,
-- so nobody can see the states in between, and a key that many coalesced requests share (a
-- global limit) costs one SET instead of one per request. The last state and its TTL are what
-- writing after every request would have left.
local final_slots, finals, final_limit, final_state, final_ttl = {}, 0, {}, {}, {}
local reply, replies = { string.format('%d', now) }, 1

-- Per check of the request at hand: allowed, remaining, reset, unconsumed, new state, TTL.
local simple_in, allowed_at, remaining_at, reset_at, unconsumed_at, new_at, ttl_at =
  {}, {}, {}, {}, {}, {}, {}

-- Most requests are only takes (a number of hits) on fixed windows or GCRA, each on its own
-- key and none in quota mode: such a request is decided, written and answered here in two
-- short passes, without the general loop's bookkeeping for charges, refunds, quotas and keys
-- checked twice and without a table per check, with the same answers and writes. Any other
-- request returns false, having changed nothing but the cache of loaded states, and goes
-- through the general loop.
local function decided_simply(r, first_check, first_arg, count)
  local allowed_all = true
  local g, arg = first_check, first_arg
  for i = 1, count do
    local c, s = limit_of[g], slot_of_check[g]
    local take = c.take
    if not take or simple_in[s] == r then
      return false
    end
    simple_in[s] = r
    local hits, n = ARGV[arg + 1], 1
    if hits ~= '1' then
      -- A take is digits; a peek, refund or charge starts with a letter.
      local byte = string.byte(hits)
      if not byte or byte < 48 or byte > 57 then
        return false
      end
      n = hits + 0
      if n > c.capacity then
        return false
      end
    end
    local st = loaded_at[s]
    if st == nil then
      st = parse(c.alg, raw_at[s])
      if st and c.window then
        window_in_redis[s] = st.window
      end
      loaded_at[s] = st
    end
    local allowed, remaining, reset, unconsumed, new, ttl = take(c, st, n, now)
    if allowed == nil then
      return false
    end
    allowed_at[i], remaining_at[i], reset_at[i], unconsumed_at[i] = allowed, remaining, reset, unconsumed
    new_at[i], ttl_at[i] = new, ttl
    if not allowed and not c.shadow then
      allowed_all = false
    end
    g, arg = g + 1, arg + 2
  end
  g = first_check
  for i = 1, count do
    replies = replies + 1
    if not allowed_at[i] then
      reply[replies] = string.format('0 %d %d', remaining_at[i], reset_at[i])
    elseif not allowed_all then
      -- Allowed, but the request is denied: nothing taken.
      reply[replies] = string.format('1 %d %d', unconsumed_at[i], reset_at[i])
    else
      local new = new_at[i]
      if new then
        -- Updated in place: every state table is this call's own, and nothing reads a slot's
        -- earlier state once a later request has committed over it.
        local c, s = limit_of[g], slot_of_check[g]
        local st = loaded_at[s]
        if c.window then
          if st then
            st.window, st.count = c.window, new
          else
            st = { window = c.window, count = new }
          end
        elseif st then
          st.tat = new
        else
          st = { tat = new }
        end
        loaded_at[s] = st
        if not final_state[s] then
          finals = finals + 1
          final_slots[finals] = s
        end
        final_limit[s], final_state[s], final_ttl[s] = c, st, ttl_at[i]
      end
      reply[replies] = string.format('1 %d %d', remaining_at[i], reset_at[i])
    end
    g = g + 1
  end
  return true
end

local next_check, next_arg = 1, first_request_arg + 1
for r = 1, request_count do
  local count = count_of[r]
  local deadline = ARGV[next_arg + 1]
  next_arg = next_arg + 2
  local first_check = next_check
  local allowed_all, quotas, quota_passed, charges = true, false, false, false
  if deadline ~= '' and now > deadline + 0 then
    -- Late: its caller has answered without it, so it reads and writes nothing.
    next_check, next_arg = next_check + count, next_arg + 2 * count
    for _ = 1, count do
      replies = replies + 1
      reply[replies] = '2 0 0'
    end
  elseif decided_simply(r, next_check, next_arg, count) then
    next_check, next_arg = next_check + count, next_arg + 2 * count
  else
    for i = 1, count do
      local c, s = limit_of[next_check], slot_of_check[next_check]
      local hits = ARGV[next_arg + 1]
      next_check, next_arg = next_check + 1, next_arg + 2
      local mode, n = 't', 1
      if hits == '1' then -- the usual case, without a conversion
      elseif hits == 'p' then
        mode = 'p'
      elseif string.byte(hits) == 114 then -- 'r'
        mode, n = 'r', string.sub(hits, 2) + 0
      elseif string.byte(hits) == 99 then -- 'c'
        mode, n = 'c', string.sub(hits, 2) + 0
      elseif string.byte(hits) == 100 then -- 'd'
        mode, n = 'd', string.sub(hits, 2) + 0
      else
        n = hits + 0
      end
      local st
      if pending_in[s] == r then
        st = pending_at[s]
      else
        st = loaded_at[s]
        if st == nil and c.l ~= 0 then
          if c.alg == 'swlc' then
            st = load_log(key_at[s], now, c.p)
          else
            st = parse(c.alg, raw_at[s])
            if st and c.window then
              window_in_redis[s] = st.window
            end
          end
          loaded_at[s] = st
        end
      end
      local allowed, remaining, reset, unconsumed, new, ttl
      if c.window and mode == 't' and n <= c.l then
        -- A plain take on a fixed window (in a request the short way does not take).
        allowed, remaining, reset, unconsumed, new, ttl = fixed_window_take(c, st, n)
        if new then
          new = { window = c.window, count = new }
        end
      end
      if allowed == nil then
        allowed, remaining, reset, unconsumed, new, ttl = assess(c, mode, n, st, now)
      end
      allowed_of[i], remaining_of[i], reset_of[i], unconsumed_of[i] = allowed, remaining, reset, unconsumed
      state_of[i], ttl_of[i], charged_of[i], charge_of[i] = new, ttl, mode == 'c', n
      if mode == 'c' then
        charges = true
      end
      if new then
        pending_at[s], pending_in[s] = new, r
      end
      -- A refund never denies: hits given back must land, even on a key over its limit.
      if mode == 'r' then
      elseif c.quota then
        quotas = true
        if allowed then
          quota_passed = true
        end
      elseif not allowed and not c.shadow then
        allowed_all = false
      end
    end
    if quotas and not quota_passed then
      allowed_all = false
    end

    -- A denied request's charges are recorded again on the stored state, so none carries the
    -- hits of an earlier check of the same key that the denial leaves uncommitted.
    if charges and not allowed_all then
      local charged_at = {}
      for i = 1, count do
        if charged_of[i] then
          local c, s = limit_of[first_check + i - 1], slot_of_check[first_check + i - 1]
          local st = charged_at[s]
          if st == nil then
            st = loaded_at[s]
          end
          -- The answer stays the one decided with the request.
          local _, _, _, _, new, ttl = assess(c, 'c', charge_of[i], st, now)
          state_of[i], ttl_of[i] = new, ttl
          if new then
            charged_at[s] = new
          end
        end
      end
    end

    -- Write each key once, with its final state (a key checked twice carries both checks' hits).
    -- A denied request writes only its charges, recorded whatever the answer.
    if allowed_all or charges then
      for i = count, 1, -1 do
        local new, s = state_of[i], slot_of_check[first_check + i - 1]
        if new and (allowed_all or charged_of[i]) and written_in[s] ~= r then
          written_in[s] = r
          local c = limit_of[first_check + i - 1]
          if c.alg == 'swlc' then
            store(c, key_at[s], new, ttl_of[i], now)
            loaded_at[s] = nil
          else
            loaded_at[s] = new
            if not final_state[s] then
              finals = finals + 1
              final_slots[finals] = s
            end
            final_limit[s], final_state[s], final_ttl[s] = c, new, ttl_of[i]
          end
        end
      end
    end
    for i = 1, count do
      local remaining = remaining_of[i]
      if not allowed_all and allowed_of[i] and not charged_of[i] then
        remaining = unconsumed_of[i]
      end
      replies = replies + 1
      -- The verdict is in the format, so only two numbers are converted.
      reply[replies] = string.format(allowed_of[i] and '1 %d %d' or '0 %d %d', remaining, reset_of[i])
    end
  end
end
for f = 1, finals do
  local s = final_slots[f]
  local c, st = final_limit[s], final_state[s]
  store(c, key_at[s], st, final_ttl[s], now, c.window and window_in_redis[s] == st.window)
end
return table.concat(reply, ' ')
