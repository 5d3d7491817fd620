#!/usr/bin/env bash
# No disaggregation: the bundled Redis, one mixed instance (prefill and decode in one engine), one
# router on $PORT (default 8000). Ctrl-C stops what it started.
#   examples/mixed.sh                  # ONESHOT=1: one request, then stop
source "$(dirname "$0")/lib.sh"
REDIS_PORT=${REDIS_PORT:-6379}
URL=redis://127.0.0.1:$REDIS_PORT/0
ensure_model
redis --port "$REDIS_PORT"
worker --role mixed --redis-url "$URL"
router --port "$PORT" --redis-url "$URL"
wait_ready "http://127.0.0.1:$PORT" 1
ask "http://127.0.0.1:$PORT"
serve "http://127.0.0.1:$PORT"
