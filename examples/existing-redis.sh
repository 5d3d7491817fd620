#!/usr/bin/env bash
# Prefill/decode on this host against a Redis you run, with TLS and a password:
#   REDIS_URL='rediss://:PASSWORD@redis.example.com:6380/0' examples/existing-redis.sh
# rediss:// turns TLS on (the server's certificate is verified against the system CAs); put the
# user before the colon for Redis ACL users (rediss://USER:PASSWORD@...). Any Redis >= 6.2 works.
# CLUSTER (default: examples) keeps this stack's keys apart from others on the same Redis.
source "$(dirname "$0")/lib.sh"
: "${REDIS_URL:?set REDIS_URL, e.g. rediss://:PASSWORD@host:6380/0}"
CLUSTER=${CLUSTER:-examples}
ensure_model
worker --role prefill --redis-url "$REDIS_URL" --cluster "$CLUSTER"
worker --role decode --redis-url "$REDIS_URL" --cluster "$CLUSTER"
router --port "$PORT" --redis-url "$REDIS_URL" --cluster "$CLUSTER"
wait_ready "http://127.0.0.1:$PORT" 2
ask "http://127.0.0.1:$PORT"
serve "http://127.0.0.1:$PORT"
