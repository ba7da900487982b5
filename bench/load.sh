#!/usr/bin/env bash
# The shop under wrk, bare and behind the layer on each store: req/s, p50, p99 and the ratio
# to bare measured in the same run, store calls per request, and the shop's peak RSS.
#
#   bash bench/load.sh                      # memory, plus Redis/Postgres when they answer
#   LOAD_SECONDS=10 LOAD_MODES="bare memory redis" bash bench/load.sh
#
# Env: LOAD_ROUNDS (default 1: every mode once; with 3, the modes run three times in turn and
# each figure is the median of its rounds, each ratio the median of per-round ratios to the
# bare shop of the same round, which cancels the machine's drift, followed by the rounds'
# range; with both Redis stores, a table of their per-round ratios), LOAD_SECONDS (per run,
# default 10), LOAD_CONNECTIONS (64), LOAD_THREADS (2),
# LOAD_MODES (bare noop memory redis postgres; noop is the shop behind a tower layer that does
# nothing, GET only: what any layer on an axum Router costs; `idempotent`, never a default, is
# the same shop handlers behind the `idempotent` 2.0 crate's middleware on its Redis store,
# served by the separate crate bench/peer, built here with `--ignore-rust-version` when the mode
# is selected: LOAD_MODES="bare redis idempotent" compares the two Redis stores in one run),
# REDIS_URL (redis://127.0.0.1:6379; a private server is better, e.g. redis-server --port 16392),
# LOAD_POST (payments: the POST cases hit POST /v1/payments, whose handler saves two recovery
# points through the layer's context, which no other middleware offers, so only the shop's
# own layer makes those store calls; orders: POST /v1/orders, a handler that reads only its
# body, the same work behind every middleware),
# POSTGRES_URL (postgres://postgres@127.0.0.1:5432/test), LOAD_OUT (a markdown file to
# write the table to). wrk comes from Debian's `wrk` package (installed when missing).
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=${LOAD_SECONDS:-10}
ROUNDS=${LOAD_ROUNDS:-1}
CONNS=${LOAD_CONNECTIONS:-64}
THREADS=${LOAD_THREADS:-2}
MODES=${LOAD_MODES:-bare noop memory redis postgres}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
POSTGRES_URL=${POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
RUN_ID="$(date +%s)-$$"
case "${LOAD_POST:-payments}" in
  payments) export LOAD_POST_PATH=/v1/payments LOAD_POST_BODY='{"amount": 1999, "currency": "eur"}' ;;
  orders) export LOAD_POST_PATH=/v1/orders LOAD_POST_BODY='{"items": [{"sku": "sku-1", "qty": 1}]}' ;;
  *) echo "LOAD_POST=${LOAD_POST}: expected payments or orders" >&2; exit 1 ;;
esac

if ! command -v wrk >/dev/null; then
  echo "installing wrk (Debian package)" >&2
  if [ "$(id -u)" = 0 ]; then apt-get install -y wrk >/dev/null; else sudo apt-get install -y wrk >/dev/null; fi
fi

echo "building the shop (release)..." >&2
cargo build --release --quiet --example shop --features axum,redis,postgres
SHOP="${CARGO_TARGET_DIR:-target}/release/examples/shop"
PEER=""
if [[ " $MODES " == *" idempotent "* ]]; then
  echo "building the peer shop, idempotent 2.0 (release, bench/peer)..." >&2
  cargo build --release --quiet --ignore-rust-version --manifest-path bench/peer/Cargo.toml
  PEER="${CARGO_TARGET_DIR:-bench/peer/target}/release/peer-shop"
fi

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
    redis|redis-tier|idempotent) store=$REDIS_URL ;;
    postgres|postgres-tier) store=$POSTGRES_URL ;;
  esac
  local bin=$SHOP; [ "$1" = idempotent ] && bin=$PEER
  local tier=0; case "$1" in *-tier) tier=1 ;; esac
  SHOP_ADDR=$ADDR CARD_LATENCY_MS=0 IDEMPOTENCY_TTL_SECS=600 RUST_LOG=warn IDEMPOTENCY_LOCAL_TIER=$tier \
    SHOP_IDEMPOTENCY=$(case "$1" in bare) echo off ;; noop) echo noop ;; idempotent) echo idempotent ;; *) echo on ;; esac) IDEMPOTENCY_STORE=$store \
    "$bin" >/tmp/load-shop-$1.log 2>&1 &
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
    redis|redis-tier|idempotent) redis-cli -u "$REDIS_URL" info commandstats | awk -F'[=,:]' '/^cmdstat_/ {s+=$3} END {print s+0}' ;;
    postgres|postgres-tier) psql -Atq "$POSTGRES_URL" -c "select xact_commit + xact_rollback from pg_stat_database where datname = current_database()" ;;
    *) echo 0 ;;
  esac
}

# CPU time (user + system, in clock ticks) of the given processes and their exited children.
# The server side: redis-server's one process, or every postgres process (the shop's pooled
# backends live for the whole run, so none is lost between two readings).
ticks() { for p in "$@"; do awk '{print $14+$15+$16+$17}' "/proc/$p/stat" 2>/dev/null; done | awk '{s+=$1} END {print s+0}'; }
# The Redis server is the one REDIS_URL names (its process_id), not any redis-server running.
server_pids() {
  case "$1" in
    redis|redis-tier|idempotent) redis-cli -u "$REDIS_URL" info server | awk -F: '/^process_id:/ {print $2+0}' ;;
    postgres|postgres-tier) pgrep -x postgres ;;
  esac
}
HZ=$(getconf CLK_TCK)

# wrk's lines -> "rps p50_ms p99_ms requests non2xx"
run_wrk() { # $1 = mode, $2 = case
  local args=(-t"$THREADS" -c"$CONNS" -d"${SECS}s" --latency)
  case "$2" in
    get) args+=("http://$ADDR/v1/charges") ;;
    unique) args+=(-s bench/unique.lua "http://$ADDR$LOAD_POST_PATH") ;;
    replay) args+=(-s bench/replay.lua "http://$ADDR$LOAD_POST_PATH") ;;
  esac
  wrk "${args[@]}" | awk '
    function ms(v) { if (v ~ /us$/) return v/1000; if (v ~ /ms$/) return v+0; if (v ~ /s$/) return v*1000; return v }
    /Requests\/sec/ {rps=$2}
    /^ +50%/ {p50=ms($2)} /^ +99%/ {p99=ms($2)}
    /requests in/ {n=$1}
    /Non-2xx/ {bad=$5}
    END {printf "%s %.3f %.3f %s %s\n", rps, p50, p99, n, bad+0}'
}

# Payments the shop's handler created so far (GET /v1/debug/stats, outside any layer's keyed
# path): a replay must not run it, a new key must.
payments() { curl -fs "http://$ADDR/v1/debug/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["payments_created"])'; }

# Each entry is a list, one value per round.
declare -A RPS P50 P99 OPS SHOPCPU SRVCPU RSS RUNS
# per_round "a1 a2 .." "b1 b2 ..": a_i / b_i for each round where b_i > 0.
per_round() { paste -d' ' <(tr ' ' '\n' <<<"$1" | grep -v '^$') <(tr ' ' '\n' <<<"$2" | grep -v '^$') | awk '$2>0 {printf "%.4f ", $1/$2}'; }
# " (lo-hi)": the rounds' range of per-round ratios, so that a noisy run shows as one; empty
# for a single round.
spread() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {if (NR>1) printf " (%.2f-%.2f)", v[1], v[NR]}'; }
# The table's name of a case.
case_name() { case "$1" in get) echo "GET pass-through" ;; unique) echo "POST, new key" ;; replay) echo "POST, replay" ;; esac; }
# The median of a space-separated list; "-" (no figure) when the list is empty or holds one.
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '$1=="-" {dash=1} {v[NR]=$1} END {if (NR==0 || dash) print "-"; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }
for round in $(seq "$ROUNDS"); do
# bench/unique.lua makes its keys from LOAD_RUN: a new one per round, or a later round's "new
# keys" would be replays of the first round's in Redis and Postgres, which keep them.
export LOAD_RUN="$RUN_ID-$round"
[ "$ROUNDS" -gt 1 ] && echo "round $round of $ROUNDS" >&2
for mode in $MODES; do
  case "$mode" in
    redis|redis-tier|idempotent) redis-cli -u "$REDIS_URL" ping >/dev/null 2>&1 || { echo "skipping $mode: $REDIS_URL does not answer" >&2; continue; } ;;
    postgres|postgres-tier) psql -Atq "$POSTGRES_URL" -c 'select 1' >/dev/null 2>&1 || { echo "skipping postgres: $POSTGRES_URL does not answer" >&2; continue; } ;;
  esac
  start_shop "$mode"
  cases="get unique replay"; [ "$mode" = noop ] && cases=get
  for c in $cases; do
    # Replays: one connection first completes the 256 keys the measured run cycles over.
    [ "$c" = replay ] && wrk -t1 -c1 -d2s -s bench/replay.lua "http://$ADDR$LOAD_POST_PATH" >/dev/null
    if [ "$c" = replay ] && [ "$mode" != bare ]; then
      # One of the warm keys again, by hand: the answer must say it is a replay.
      curl -fsi -X POST "http://$ADDR$LOAD_POST_PATH" -H "Idempotency-Key: r-$LOAD_RUN-1" \
        -H 'Content-Type: application/json' -d "$LOAD_POST_BODY" \
        | grep -qi '^idempotent-replayed: true' || echo "warning: $mode: a warm key's answer has no idempotent-replayed: true" >&2
    fi
    made0=$(payments)
    before=$(store_ops "$mode")
    srv=$(server_pids "$mode"); cpu0=$(ticks "$pid"); srv0=$(ticks $srv)
    read -r rps p50 p99 n bad < <(run_wrk "$mode" "$c")
    cpu1=$(ticks "$pid"); srv1=$(ticks $srv)
    after=$(store_ops "$mode")
    made1=$(payments)
    # Microseconds of CPU per request: the shop's, and the store server's.
    SHOPCPU[$mode.$c]+=$(awk -v a="$cpu1" -v b="$cpu0" -v n="$n" -v hz="$HZ" 'BEGIN {printf "%.1f ", (a-b)*1e6/hz/n}')
    SRVCPU[$mode.$c]+=$(awk -v a="$srv1" -v b="$srv0" -v n="$n" -v hz="$HZ" -v s="$srv" 'BEGIN {if (s=="") printf "- "; else printf "%.1f ", (a-b)*1e6/hz/n}')
    RPS[$mode.$c]+="$rps "; P50[$mode.$c]+="$p50 "; P99[$mode.$c]+="$p99 "
    if [[ "$mode" == redis* || "$mode" == idempotent || "$mode" == postgres* ]]; then
      # The store_ops probe itself is one command (Redis INFO) or transaction.
      OPS[$mode.$c]+=$(awk -v a="$after" -v b="$before" -v n="$n" 'BEGIN {printf "%.2f ", (a-b-1)/n}')
    else
      OPS[$mode.$c]="- "
    fi
    [ "$bad" != 0 ] && echo "warning: $mode/$c: $bad responses were not 2xx" >&2
    # Counted for payments only (GET /v1/debug/stats has no count of orders).
    if [ "$c" != get ] && [ "$LOAD_POST_PATH" = /v1/payments ]; then
      # Handler runs per answered request (wrk counts answers; a run ends with requests in flight).
      RUNS[$mode.$c]+=$(awk -v a="$made1" -v b="$made0" -v n="$n" 'BEGIN {printf "%.3f ", (a-b)/n}')
      if [ "$mode" != bare ] && [ "$c" = replay ] && [ "$made1" != "$made0" ]; then
        echo "warning: $mode/replay: the handler ran $((made1 - made0)) times" >&2
      fi
      if [ "$c" = unique ] && [ $((made1 - made0)) -lt "$n" ]; then
        echo "warning: $mode/unique: $n answers but $((made1 - made0)) handler runs" >&2
      fi
    else
      RUNS[$mode.$c]="- "
    fi
    echo "$mode $c: $rps req/s, p50 ${p50} ms, p99 ${p99} ms, $bad non-2xx" >&2
  done
  stop_shop
  RSS[$mode]+="$peak_rss_kb "
done
done

{
  echo "wrk -t$THREADS -c$CONNS -d${SECS}s, $ROUNDS round(s) (medians), shop with CARD_LATENCY_MS=0, POST cases on $LOAD_POST_PATH, $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  echo "| store | case | req/s | p50 ms | p99 ms | vs bare (req/s) | p99 vs bare | shop CPU µs/request | store server CPU µs/request | store calls/request (Redis: commands incl. inside scripts; Postgres: transactions) | handler runs/request |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for mode in $MODES; do
    for c in get unique replay; do
      [ -n "${RPS[$mode.$c]:-}" ] || continue
      # Ratios per round (to that round's bare shop), then their median.
      rounds=$(per_round "${RPS[$mode.$c]}" "${RPS[bare.$c]:-}")
      ratio=$(median <<<"$rounds")
      p99r=$(per_round "${P99[$mode.$c]}" "${P99[bare.$c]:-}" | median)
      fmt() { awk -v v="$1" -v d="$2" 'BEGIN {if (v=="-") print "-"; else printf "%." d "f", v}'; }
      ratio=$(fmt "$ratio" 2); [ "$ratio" != - ] && ratio="${ratio}x$(spread "$rounds")"
      p99r=$(fmt "$p99r" 2); [ "$p99r" != - ] && p99r="${p99r}x"
      echo "| $mode | $(case_name "$c") | $(fmt "$(median <<<"${RPS[$mode.$c]}")" 0) | $(fmt "$(median <<<"${P50[$mode.$c]}")" 3) | $(fmt "$(median <<<"${P99[$mode.$c]}")" 3) | $ratio | $p99r | $(fmt "$(median <<<"${SHOPCPU[$mode.$c]}")" 1) | $(fmt "$(median <<<"${SRVCPU[$mode.$c]}")" 1) | $(fmt "$(median <<<"${OPS[$mode.$c]}")" 2) | $(fmt "$(median <<<"${RUNS[$mode.$c]}")" 3) |"
    done
  done
  # The two Redis stores beside each other, round by round, when both ran.
  if [ -n "${RPS[redis.unique]:-}" ] && [ -n "${RPS[idempotent.unique]:-}" ]; then
    echo
    echo "| case | redis vs idempotent (req/s) |"
    echo "|---|---:|"
    for c in get unique replay; do
      rounds=$(per_round "${RPS[redis.$c]}" "${RPS[idempotent.$c]:-}")
      echo "| $(case_name "$c") | $(awk -v v="$(median <<<"$rounds")" 'BEGIN {printf "%.2f", v}')x$(spread "$rounds") |"
    done
  fi
  echo
  echo "| store | shop peak RSS (VmHWM) |"
  echo "|---|---:|"
  for mode in $MODES; do
    [ -n "${RSS[$mode]:-}" ] || continue
    max=$(tr ' ' '\n' <<<"${RSS[$mode]}" | grep -v '^$' | sort -n | tail -1)
    echo "| $mode | $(( max / 1024 )) MiB |"
  done
} | if [ -n "${LOAD_OUT:-}" ]; then tee "$LOAD_OUT"; else cat; fi
