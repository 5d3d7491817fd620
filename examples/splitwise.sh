#!/usr/bin/env bash
# Prefill/decode on this host: the bundled Redis, one prefill and one decode instance (KV through
# shared memory), one router on $PORT (default 8000). Ctrl-C stops what it started.
#   examples/splitwise.sh              # ONESHOT=1: one request, then stop
source "$(dirname "$0")/lib.sh"
REDIS_PORT=${REDIS_PORT:-6379}
URL=redis://127.0.0.1:$REDIS_PORT/0
ensure_model
redis --port "$REDIS_PORT"
worker --role prefill --redis-url "$URL"
worker --role decode --redis-url "$URL"
router --port "$PORT" --redis-url "$URL"
wait_ready "http://127.0.0.1:$PORT" 2
ask "http://127.0.0.1:$PORT"
serve "http://127.0.0.1:$PORT"
