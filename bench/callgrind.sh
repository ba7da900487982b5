#!/usr/bin/env bash
# User-space instructions per request of the shop, counted by callgrind: repeatable on a
# noisy machine, where wrk's req/s are not. One keep-alive connection sends the requests
# (bench/client.py); the count is the difference between a run of 1,300 and one of 300
# requests, divided by 1,000, so start-up and shutdown cancel out.
#
#   bash bench/callgrind.sh                 # every mode and case
#   bash bench/callgrind.sh on replay       # one
#   CALLGRIND_OUT=/tmp/cg bash bench/callgrind.sh on unique   # and keep the profiles
#
# Modes: off (no layer), noop (a tower layer that does nothing), on (the idempotency layer on
# the memory store). Cases: get (pass-through), unique (a new key each), replay, all three on
# /v1/payments; order and order-replay, the same on /v1/orders, whose handler does the same
# work with and without the layer (bench/client.py).
# IDEMPOTENCY_STORE=redis://127.0.0.1:16392 puts the `on` mode on that store (a private,
# emptied Redis: the count includes the store's client, not the server).
# Under valgrind sha2 runs its portable code (no SHA extensions), so SHA-256 weighs several
# times more here than on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "installing valgrind" >&2; apt-get install -y valgrind >/dev/null; }
features=axum
case "${IDEMPOTENCY_STORE:-}" in
  redis*) features=axum,redis ;;
  postgres*) features=axum,postgres ;;
esac
cargo build --release --quiet --example shop --features "$features"
SHOP="${CARGO_TARGET_DIR:-target}/release/examples/shop"
# CALLGRIND_OUT=dir keeps the profiles (cg.<mode>.<case>.<n>) for callgrind_annotate.
if [ -n "${CALLGRIND_OUT:-}" ]; then
  out=$CALLGRIND_OUT; mkdir -p "$out"
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi

count() { # mode case n -> total instructions
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  SHOP_ADDR=127.0.0.1:$port CARD_LATENCY_MS=0 RUST_LOG=warn SHOP_IDEMPOTENCY=$1 \
    valgrind --tool=callgrind --callgrind-out-file="$out/cg.$1.$2.$3" "$SHOP" >/dev/null 2>&1 &
  local pid=$!
  python3 bench/client.py "$port" "$3" "$2"
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
  awk '/^(summary|totals):/ {print $2; exit}' "$out/cg.$1.$2.$3"
}

sha() { # mode case n -> instructions in SHA-256's block function (0 if it never ran)
  callgrind_annotate --inclusive=yes "$out/cg.$1.$2.$3" 2>/dev/null |
    awk '/sha2::sha256::compress256/ && !found {gsub(",", "", $1); n=$1; found=1} END {print n+0}'
}

run() { # mode case
  local a b sa sb
  a=$(count "$1" "$2" 300); b=$(count "$1" "$2" 1300)
  sa=$(sha "$1" "$2" 300); sb=$(sha "$1" "$2" 1300)
  echo "| $1 | $2 | $(( (b - a) / 1000 )) | $(( (b - a - sb + sa) / 1000 )) |"
}

# The last column leaves out sha2's compress256, which runs portable code under valgrind
# and the CPU's SHA extensions in production, where it weighs several times less.
echo "| mode | case | instructions per request | without SHA-256 blocks |"
echo "|---|---|---:|---:|"
if [ $# -eq 2 ]; then run "$1" "$2"; exit; fi
run off get; run noop get; run on get
run off unique; run on unique; run on replay
run off order; run on order; run on order-replay
