#!/usr/bin/env bash
# The shop under wrk, bare and behind the layer on each store: req/s, p50, p99 and the ratio
# to bare measured in the same run, store calls per request, and the shop's peak RSS.
#
#   bash bench/load.sh                      # memory, plus Redis/Postgres when they answer
#   LOAD_SECONDS=10 LOAD_MODES="bare memory redis" bash bench/load.sh
#
# Env: LOAD_SECONDS (per run, default 10), LOAD_CONNECTIONS (64), LOAD_THREADS (2),
# LOAD_MODES (bare noop memory redis postgres; noop is the shop behind a tower layer that does
# nothing, GET only: what any layer on an axum Router costs), REDIS_URL (redis://127.0.0.1:6379),
# POSTGRES_URL (postgres://postgres@127.0.0.1:5432/test), LOAD_OUT (a markdown file to
# write the table to). wrk comes from Debian's `wrk` package (installed when missing).
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=${LOAD_SECONDS:-10}
CONNS=${LOAD_CONNECTIONS:-64}
THREADS=${LOAD_THREADS:-2}
MODES=${LOAD_MODES:-bare noop memory redis postgres}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
POSTGRES_URL=${POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
export LOAD_RUN="$(date +%s)-$$"

if ! command -v wrk >/dev/null; then
  echo "installing wrk (Debian package)" >&2
  if [ "$(id -u)" = 0 ]; then apt-get install -y wrk >/dev/null; else sudo apt-get install -y wrk >/dev/null; fi
fi

echo "building the shop (release)..." >&2
cargo build --release --quiet --example shop --features axum,redis,postgres
SHOP="${CARGO_TARGET_DIR:-target}/release/examples/shop"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ADDR="127.0.0.1:$port"
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; }
trap cleanup EXIT

start_shop() { # $1 = mode
  local store
  case "$1" in
    bare|noop) store=memory ;;
    memory) store=memory ;;
    redis) store=$REDIS_URL ;;
    postgres) store=$POSTGRES_URL ;;
  esac
  SHOP_ADDR=$ADDR CARD_LATENCY_MS=0 IDEMPOTENCY_TTL_SECS=600 RUST_LOG=warn \
    SHOP_IDEMPOTENCY=$(case "$1" in bare) echo off ;; noop) echo noop ;; *) echo on ;; esac) IDEMPOTENCY_STORE=$store \
    "$SHOP" >/tmp/load-shop-$1.log 2>&1 &
  pid=$!
  for _ in $(seq 100); do
    curl -fs "http://$ADDR/v1/charges" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || { cat /tmp/load-shop-$1.log >&2; return 1; }
    sleep 0.1
  done
  echo "shop did not start" >&2; return 1
}

stop_shop() {
  peak_rss_kb=$(awk '/VmHWM/ {print $2}' /proc/$pid/status)
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
}

# Store calls so far: Redis commands (INFO commandstats, which counts the commands a script
# runs inside it too), Postgres transactions (each of the store's statements is one, and one
# round trip). Redis round trips per operation are asserted by tests/redis_store.rs (new key
# 2, replay 1): under load a multiplexed connection pipelines many requests per socket read,
# so socket reads do not count them.
store_ops() {
  case "$1" in
    redis) redis-cli -u "$REDIS_URL" info commandstats | awk -F'[=,:]' '/^cmdstat_/ {s+=$3} END {print s+0}' ;;
    postgres) psql -Atq "$POSTGRES_URL" -c "select xact_commit + xact_rollback from pg_stat_database where datname = current_database()" ;;
    *) echo 0 ;;
  esac
}

# wrk's lines -> "rps p50_ms p99_ms requests non2xx"
run_wrk() { # $1 = mode, $2 = case
  local args=(-t"$THREADS" -c"$CONNS" -d"${SECS}s" --latency)
  case "$2" in
    get) args+=("http://$ADDR/v1/charges") ;;
    unique) args+=(-s bench/unique.lua "http://$ADDR/v1/payments") ;;
    replay) args+=(-s bench/replay.lua "http://$ADDR/v1/payments") ;;
  esac
  wrk "${args[@]}" | awk '
    function ms(v) { if (v ~ /us$/) return v/1000; if (v ~ /ms$/) return v+0; if (v ~ /s$/) return v*1000; return v }
    /Requests\/sec/ {rps=$2}
    /^ +50%/ {p50=ms($2)} /^ +99%/ {p99=ms($2)}
    /requests in/ {n=$1}
    /Non-2xx/ {bad=$5}
    END {printf "%s %.3f %.3f %s %s\n", rps, p50, p99, n, bad+0}'
}

declare -A RPS P50 P99 OPS
rows=()
for mode in $MODES; do
  case "$mode" in
    redis) redis-cli -u "$REDIS_URL" ping >/dev/null 2>&1 || { echo "skipping redis: $REDIS_URL does not answer" >&2; continue; } ;;
    postgres) psql -Atq "$POSTGRES_URL" -c 'select 1' >/dev/null 2>&1 || { echo "skipping postgres: $POSTGRES_URL does not answer" >&2; continue; } ;;
  esac
  start_shop "$mode"
  cases="get unique replay"; [ "$mode" = noop ] && cases=get
  for c in $cases; do
    # Replays: one connection first completes the 256 keys the measured run cycles over.
    [ "$c" = replay ] && wrk -t1 -c1 -d2s -s bench/replay.lua "http://$ADDR/v1/payments" >/dev/null
    before=$(store_ops "$mode")
    read -r rps p50 p99 n bad < <(run_wrk "$mode" "$c")
    after=$(store_ops "$mode")
    RPS[$mode.$c]=$rps; P50[$mode.$c]=$p50; P99[$mode.$c]=$p99
    if [ "$mode" = redis ] || [ "$mode" = postgres ]; then
      # The store_ops probe itself is one command (Redis INFO) or transaction.
      OPS[$mode.$c]=$(awk -v a="$after" -v b="$before" -v n="$n" 'BEGIN {printf "%.2f", (a-b-1)/n}')
    else
      OPS[$mode.$c]="-"
    fi
    [ "$bad" != 0 ] && echo "warning: $mode/$c: $bad responses were not 2xx" >&2
    echo "$mode $c: $rps req/s, p50 ${p50} ms, p99 ${p99} ms, $bad non-2xx" >&2
  done
  stop_shop
  rows+=("$mode $peak_rss_kb")
done

{
  echo "wrk -t$THREADS -c$CONNS -d${SECS}s, shop with CARD_LATENCY_MS=0, $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  echo "| store | case | req/s | p50 ms | p99 ms | vs bare (req/s) | p99 vs bare | store calls/request (Redis: commands incl. inside scripts; Postgres: transactions) |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|"
  for mode in $MODES; do
    for c in get unique replay; do
      [ -n "${RPS[$mode.$c]:-}" ] || continue
      ratio=$(awk -v a="${RPS[$mode.$c]}" -v b="${RPS[bare.$c]:-0}" 'BEGIN {if (b>0) printf "%.2fx", a/b; else print "-"}')
      p99r=$(awk -v a="${P99[$mode.$c]}" -v b="${P99[bare.$c]:-0}" 'BEGIN {if (b>0) printf "%.2fx", a/b; else print "-"}')
      name=$c; [ "$c" = get ] && name="GET pass-through"; [ "$c" = unique ] && name="POST, new key"; [ "$c" = replay ] && name="POST, replay"
      echo "| $mode | $name | ${RPS[$mode.$c]} | ${P50[$mode.$c]} | ${P99[$mode.$c]} | $ratio | $p99r | ${OPS[$mode.$c]} |"
    done
  done
  echo
  echo "| store | shop peak RSS (VmHWM) |"
  echo "|---|---:|"
  for r in "${rows[@]}"; do set -- $r; echo "| $1 | $(( $2 / 1024 )) MiB |"; done
} | if [ -n "${LOAD_OUT:-}" ]; then tee "$LOAD_OUT"; else cat; fi
