#!/usr/bin/env bash
# Prefill on host A, decode on host B, the KV cache over Mooncake TCP between them.
#   host A:  HOST_A=10.0.0.1 HOST_B=10.0.0.2 REDIS_PASSWORD=... examples/two-hosts.sh a
#   host B:  HOST_A=10.0.0.1 HOST_B=10.0.0.2 REDIS_PASSWORD=... examples/two-hosts.sh b
# Host A runs Redis (on HOST_A, with the password), the prefill instance and the router ($PORT);
# host B runs the decode instance. Change HOST_A/HOST_B to your hosts' addresses; ports
# 15000-17000 (Mooncake) and 6379 must be open from B to A and from A to B. Ctrl-C stops what
# the script started on that host.
source "$(dirname "$0")/lib.sh"
: "${HOST_A:?set HOST_A to host A's address}" "${HOST_B:?set HOST_B to host B's address}"
: "${REDIS_PASSWORD:?set REDIS_PASSWORD (Redis listens beyond loopback)}"
URL="redis://:$REDIS_PASSWORD@$HOST_A:6379/0"
ensure_model   # seeded: the same weights on both hosts
case "${1:-}" in
a)
    redis --bind "$HOST_A" --password "$REDIS_PASSWORD" --port 6379
    worker --role prefill --redis-url "$URL" --hostname host-a --transfer-address "$HOST_A"
    router --host "$HOST_A" --port "$PORT" --redis-url "$URL"
    wait_ready "http://$HOST_A:$PORT" 1
    serve "http://$HOST_A:$PORT"
    ;;
b)
    worker --role decode --redis-url "$URL" --hostname host-b --transfer-address "$HOST_B"
    ONESHOT=0 serve "(decode instance; clients use host A's router)"
    ;;
*)
    echo "usage: $0 a|b (which host this is)" >&2
    exit 2
    ;;
esac
