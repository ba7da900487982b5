-- POST /v1/payments (or LOAD_POST_PATH) with a new Idempotency-Key on every request.
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local n = 0
local run = os.getenv("LOAD_RUN") or tostring(os.time())
-- LOAD_POST_PATH and LOAD_POST_BODY (set by load.sh's LOAD_POST) pick the route.
local path = os.getenv("LOAD_POST_PATH") or "/v1/payments"
local body = os.getenv("LOAD_POST_BODY") or '{"amount": 1999, "currency": "eur"}'
function request()
  n = n + 1
  return wrk.format("POST", path, {
    ["Idempotency-Key"] = "u-" .. run .. "-" .. tid .. "-" .. n,
    ["Content-Type"] = "application/json",
  }, body)
end
