"""Sends N requests of one case over one keep-alive connection: bench/callgrind.sh's client."""
import http.client
import sys
import time

port, n, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
for _ in range(1200):  # valgrind starts slowly
    try:
        c = http.client.HTTPConnection("127.0.0.1", port)
        c.request("GET", "/v1/charges")
        c.getresponse().read()
        break
    except OSError:
        time.sleep(0.2)
else:
    sys.exit("the shop did not start")
# The order cases post where the handler does the same work with the layer and without;
# on /v1/payments the layer's context makes the handler derive a card key and save two
# recovery points, which the bare baseline skips.
order = case.startswith("order")
path = "/v1/orders" if order else "/v1/payments"
body = (b'{"items": [{"sku": "tea", "qty": 2}]}' if order
        else b'{"amount": 1999, "currency": "eur"}')
run = time.time_ns()
for i in range(n):
    if case == "get":
        c.request("GET", "/v1/charges")
    else:
        unique = case in ("unique", "order")
        # Replays cycle over 16 keys of this run's own: its first 16 requests are new keys
        # in both runs of a case, so they cancel out even in a store that outlives the shop.
        key = "u-%d-%d" % (run, i) if unique else "r-%d-%d" % (run, i % 16)
        c.request("POST", path, body,
                  {"Idempotency-Key": key, "Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    if r.status not in (200, 201):
        sys.exit("unexpected status %d" % r.status)
