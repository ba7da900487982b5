-- POST /v1/payments with a new Idempotency-Key on every request.
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local n = 0
local run = os.getenv("LOAD_RUN") or tostring(os.time())
local body = '{"amount": 1999, "currency": "eur"}'
function request()
  n = n + 1
  return wrk.format("POST", "/v1/payments", {
    ["Idempotency-Key"] = "u-" .. run .. "-" .. tid .. "-" .. n,
    ["Content-Type"] = "application/json",
  }, body)
end
