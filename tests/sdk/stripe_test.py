#!/usr/bin/env python3
"""The official Stripe Python SDK against `cargo run --example stripe`, through a proxy that
drops answers.

Usage: stripe_test.py <host:port of the example>   (in a venv with `pip install stripe`)

The proxy (asyncio, on loopback) forwards one request per connection. For POSTs it drops
the first DROPS_PER_KEY answers of each Idempotency-Key: it reads the server's whole answer,
then closes the client's connection without a byte, so the charge ran but the SDK sees a
lost connection and retries with the same key. For keys starting with `inflight-` it cuts
the first attempt as soon as the request is sent, while the (slow) charge still runs, so the
SDK's retry meets it in flight: `409 idempotency_key_in_use`.

Asserts:
- each charge ran once on the server (its `GET /v1/charges` list), whatever the drops;
- every retry after a drop got the first answer (`Idempotent-Replayed: true`, same id);
- a key reused with another amount raises `stripe.IdempotencyError` (a 400 in Stripe's shape);
- a duplicate in flight gets a 409 in Stripe's shape with `Retry-After`, and the SDK ends
  with the one charge.

Every loop is bounded: the SDK's retries (max_network_retries = 3), the number of charges,
and a deadline on every socket read.
"""

import asyncio
import json
import os
import sys
import threading
from collections import Counter, defaultdict

os.environ["NO_PROXY"] = "127.0.0.1,localhost"  # requests must not route loopback elsewhere

import stripe  # noqa: E402

DROPS_PER_KEY = 2  # each charge's first two answers are lost: two retries, then a replay
CHARGES = 6
IO_TIMEOUT = 15.0  # seconds, for any one read from either side


class Proxy:
    """A loopback TCP proxy for HTTP/1.1 with a fault plan per Idempotency-Key."""

    def __init__(self, upstream):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.attempts = Counter()  # POST attempts per key
        self.statuses = Counter()  # statuses of the answers the server gave to POSTs
        self.dropped = 0  # answers read from the server, never delivered
        self.cut = 0  # attempts cut before the server answered
        self.replays = 0  # answers marked Idempotent-Replayed: true
        self.in_flight_answers = []  # (headers, body) of each 409
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = None
        threading.Thread(target=self._run, daemon=True).start()
        if not self.ready.wait(10):
            sys.exit("the proxy did not start")

    def _run(self):
        asyncio.set_event_loop(self.loop)

        async def start():
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self.ready.set()
            async with server:
                await server.serve_forever()

        self.loop.run_until_complete(start())

    async def _serve(self, reader, writer):
        try:
            await self._forward(reader, writer)
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _forward(self, reader, writer):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
        lines = head.decode("latin-1").split("\r\n")
        method = lines[0].split(" ", 1)[0]
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(reader.readexactly(length), IO_TIMEOUT)
        # One request per connection: the server closes after its answer.
        kept = [l for l in lines[1:] if l and not l.lower().startswith("connection:")]
        request = "\r\n".join([lines[0], *kept, "Connection: close", "", ""]).encode("latin-1")

        key = headers.get("idempotency-key") if method == "POST" else None
        with self.lock:
            attempt = self.attempts[key] + 1 if key else 0
            if key:
                self.attempts[key] = attempt

        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        try:
            up_writer.write(request + body)
            await up_writer.drain()
            if key and key.startswith("inflight-") and attempt == 1:
                # Cut the client now; the server's answer is read and thrown away later.
                with self.lock:
                    self.cut += 1
                writer.transport.abort()
                await asyncio.wait_for(up_reader.read(), IO_TIMEOUT)
                return
            answer = await asyncio.wait_for(up_reader.read(), IO_TIMEOUT)
        finally:
            up_writer.close()

        if key:
            self._note(answer)
            if not key.startswith("inflight-") and attempt <= DROPS_PER_KEY:
                with self.lock:
                    self.dropped += 1
                writer.transport.abort()  # the charge ran; its answer is lost
                return
        writer.write(answer)
        await writer.drain()

    def _note(self, answer):
        head, _, body = answer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        with self.lock:
            self.statuses[status] += 1
            if headers.get("idempotent-replayed") == "true":
                self.replays += 1
            if status == 409:
                self.in_flight_answers.append((headers, body))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    proxy = Proxy(sys.argv[1])
    stripe.api_key = "sk_test_x"
    stripe.api_base = f"http://127.0.0.1:{proxy.port}"
    stripe.max_network_retries = 3
    stripe.default_http_client = stripe.RequestsClient(timeout=IO_TIMEOUT)

    failures = []

    def check(cond, what):
        print(("ok    " if cond else "FAIL  ") + what)
        if not cond:
            failures.append(what)

    # 1. Charges with the SDK's own keys, each answer dropped twice.
    made = []
    for i in range(CHARGES):
        charge = stripe.Charge.create(amount=1000 + i, currency="eur", description=f"order {i}")
        made.append(charge)
    check(len({c.id for c in made}) == CHARGES, f"{CHARGES} charges, {CHARGES} distinct ids")
    check(proxy.dropped == CHARGES * DROPS_PER_KEY, f"{proxy.dropped} answers dropped")
    check(
        all(n == DROPS_PER_KEY + 1 for n in proxy.attempts.values()),
        f"each key sent {DROPS_PER_KEY + 1} times: {sorted(set(proxy.attempts.values()))}",
    )

    # 2. A key of our own: the same request replays, another amount is an IdempotencyError.
    first = stripe.Charge.create(amount=2500, currency="eur", idempotency_key="order-reuse-1")
    again = stripe.Charge.create(amount=2500, currency="eur", idempotency_key="order-reuse-1")
    check(first.id == again.id, f"the same key and request replay {first.id}")
    raised = None
    try:
        stripe.Charge.create(amount=9999, currency="eur", idempotency_key="order-reuse-1")
    except stripe.IdempotencyError as e:
        raised = e
    except stripe.StripeError as e:
        check(False, f"a reused key raised {type(e).__name__} ({e.http_status}), not IdempotencyError")
    check(raised is not None, "a key reused with another amount raises stripe.IdempotencyError")
    if raised is not None:
        check(raised.http_status == 400, f"... with status {raised.http_status}")
        check(raised.error.type == "idempotency_error", f"... type {raised.error.type}")
        check(raised.error.code == "key_reused", f"... code {raised.error.code}")

    # 3. A slow charge whose first attempt is cut: the SDK's retry meets it in flight.
    slow = stripe.Charge.create(
        amount=4200,
        currency="eur",
        metadata={"latency_ms": "1500"},
        idempotency_key="inflight-1",
    )
    check(proxy.cut == 1, "the slow charge's first attempt was cut before its answer")
    check(len(proxy.in_flight_answers) >= 1, f"{len(proxy.in_flight_answers)} answers 409 in flight")
    for headers, body in proxy.in_flight_answers[:1]:
        error = json.loads(body).get("error") or {}
        check(error.get("type") == "idempotency_error", f"409 type {error.get('type')}")
        check(error.get("code") == "idempotency_key_in_use", f"409 code {error.get('code')}")
        check("retry-after" in headers, f"409 Retry-After: {headers.get('retry-after')}")

    # The server's own count: one charge per key, whatever the retries.
    listed = stripe.Charge.list(limit=100).data
    runs = Counter(c.id for c in listed)
    expected = CHARGES + 2  # the charges, the reused key's one, the slow one
    check(len(listed) == expected, f"the server ran {len(listed)} charges for {expected} keys")
    check(all(n == 1 for n in runs.values()), "no charge id twice")
    sdk_ids = {c.id for c in made} | {first.id, slow.id}
    check(sdk_ids == set(runs), "every id the SDK got is one the server made")

    keys = len(proxy.attempts)
    posts = sum(proxy.attempts.values())
    print(
        f"\nfigures: charges={len(listed)} keys={keys} posts={posts} retries={posts - keys} "
        f"dropped={proxy.dropped} cut={proxy.cut} replays={proxy.replays} "
        f"statuses={dict(sorted(proxy.statuses.items()))} "
        f"idempotency_errors={int(raised is not None)} stripe={stripe.VERSION}"
    )
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")


if __name__ == "__main__":
    main()
