-- wrk script for the gateway benchmark: one request shape per run, chosen
-- by environment variables, and a count of responses by status so that
-- "unexpected statuses" can be told apart from the expected 501 or 401.
--
--   SVC_BENCH_METHOD  GET or POST
--   SVC_BENCH_TOKEN   bearer token ("" for none)
--   SVC_BENCH_AGENT   X-SVC-Agent-ID ("" for none)
--   SVC_BENCH_TOKENS_FILE  optional: one bearer token per line; each
--                     request then carries the next one in turn (each
--                     thread starting elsewhere in the list) instead of
--                     SVC_BENCH_TOKEN
--   SVC_BENCH_MODEL   the chat body's model ("demo" by default)
--   SVC_BENCH_STREAM  "true": the chat body asks for a stream
--   SVC_BENCH_INPUT   optional: an embeddings body of this one input
--                     (decisions D13) instead of the chat body
--   SVC_BENCH_CONTENT optional: a memory's body of this content (decisions
--                     D13, POST /v1/memories) instead of the chat body
--   SVC_BENCH_SUBJECTS optional: each request carries the next of this many
--                     X-SVC-Memory-Subject values in turn (bench-1 ...), so
--                     that adds spread over that many scopes
--   SVC_BENCH_VARY    "true": each request's message is another text
--                     ("hello <n>", n counting per thread from its own
--                     start), so that nothing of one request's recall
--                     (decisions D13) answers the next
--   SVC_BENCH_SHAPE   "messages": the body is Anthropic's Messages API's
--                     (decisions D14: max_tokens, the same one user turn)
--                     instead of a chat completion's, with the
--                     anthropic-version header Anthropic's SDKs send
--   SVC_BENCH_KEY_HEADER  "x-api-key": the token goes in that header (as
--                     Anthropic's SDKs send it) instead of Authorization

local method = os.getenv("SVC_BENCH_METHOD") or "POST"
local token = os.getenv("SVC_BENCH_TOKEN") or ""
local agent = os.getenv("SVC_BENCH_AGENT") or ""
local tokensFile = os.getenv("SVC_BENCH_TOKENS_FILE") or ""
local model = os.getenv("SVC_BENCH_MODEL") or "demo"
local stream = os.getenv("SVC_BENCH_STREAM") or "false"
local input = os.getenv("SVC_BENCH_INPUT") or ""
local content = os.getenv("SVC_BENCH_CONTENT") or ""
local subjects = tonumber(os.getenv("SVC_BENCH_SUBJECTS") or "0") or 0
local vary = os.getenv("SVC_BENCH_VARY") or "false"
local shape = os.getenv("SVC_BENCH_SHAPE") or "chat"
local keyHeader = os.getenv("SVC_BENCH_KEY_HEADER") or ""

-- The header and value that carry a token.
local function credential(secret)
  if keyHeader ~= "" then
    return keyHeader, secret
  end
  return "Authorization", "Bearer " .. secret
end

-- The body of one chat completion or Messages request of this text.
local function conversation(text)
  if shape == "messages" then
    return '{"model":"' .. model .. '","max_tokens":256,'
      .. '"messages":[{"role":"user","content":"' .. text .. '"}],"stream":' .. stream .. '}'
  end
  return '{"model":"' .. model .. '","messages":[{"role":"user","content":"' .. text .. '"}],'
    .. '"stream":' .. stream .. '}'
end

wrk.method = method
if method == "POST" then
  if content ~= "" then
    wrk.body = '{"content":"' .. content .. '"}'
  elseif input ~= "" then
    wrk.body = '{"model":"' .. model .. '","input":"' .. input .. '"}'
  else
    wrk.body = conversation("hello")
  end
  wrk.headers["Content-Type"] = "application/json"
  if shape == "messages" then
    wrk.headers["anthropic-version"] = "2023-06-01"
  end
end
if token ~= "" then
  local name, value = credential(token)
  wrk.headers[name] = value
end
if agent ~= "" then
  wrk.headers["X-SVC-Agent-ID"] = agent
end

local threads = {}

function setup(thread)
  table.insert(threads, thread)
  thread:set("offset", #threads * 509)
end

function init(args)
  statuses = {}
  if tokensFile ~= "" then
    -- Formatted once here, so that each request costs wrk a table lookup.
    requests = {}
    for line in io.lines(tokensFile) do
      local name, value = credential(line)
      wrk.headers[name] = value
      table.insert(requests, wrk.format())
    end
    nextRequest = offset % #requests
  elseif subjects > 0 then
    requests = {}
    for index = 1, subjects do
      wrk.headers["X-SVC-Memory-Subject"] = "bench-" .. index
      table.insert(requests, wrk.format())
    end
    nextRequest = offset % #requests
  end
end

if vary == "true" then
  function request()
    counter = (counter or offset * 1000000) + 1
    return wrk.format(nil, nil, nil, conversation("hello " .. counter))
  end
elseif tokensFile ~= "" or subjects > 0 then
  function request()
    nextRequest = nextRequest % #requests + 1
    return requests[nextRequest]
  end
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local counts = {}
  for _, thread in ipairs(threads) do
    local seen = thread:get("statuses")
    for status, count in pairs(seen) do
      counts[status] = (counts[status] or 0) + count
    end
  end
  local parts = {}
  for status, count in pairs(counts) do
    table.insert(parts, string.format('"%d": %d', status, count))
  end
  io.write(string.format(
    'RESULT {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "p999_us": %d, '
      .. '"socket_errors": %d, "statuses": {%s}}\n',
    summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9),
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    table.concat(parts, ", ")))
end
