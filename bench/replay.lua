-- POST /v1/payments cycling over 256 keys that the warm-up already completed: replays.
local n = 0
local run = os.getenv("LOAD_RUN") or tostring(os.time())
local body = '{"amount": 1999, "currency": "eur"}'
function request()
  n = n + 1
  return wrk.format("POST", "/v1/payments", {
    ["Idempotency-Key"] = "r-" .. run .. "-" .. (n % 256),
    ["Content-Type"] = "application/json",
  }, body)
end
