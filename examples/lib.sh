# Shared by the example scripts: start pdserve processes, wait for them, stop exactly those.
# Stopping is by the pids this script started (workers first, so that they drain; then routers,
# then Redis), never by process name.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PDSERVE=${PDSERVE:-.venv/bin/pdserve}
[ -x "$PDSERVE" ] || PDSERVE=pdserve
MODEL=${MODEL:-models/tiny}
PORT=${PORT:-8000}
WORKERS=() ROUTERS=() SERVERS=()

stop_all() {
    local group pid
    for group in WORKERS ROUTERS SERVERS; do
        local -n pids=$group
        for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
        for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    done
}
trap stop_all EXIT
trap 'exit 130' INT TERM

ensure_model() { [ -f "$MODEL/config.json" ] || "$PDSERVE" model init "$MODEL" --preset tiny; }
worker() { "$PDSERVE" worker --model "$MODEL" "$@" & WORKERS+=($!); }
router() { "$PDSERVE" router "$@" & ROUTERS+=($!); }
redis() { "$PDSERVE" redis "$@" & SERVERS+=($!); }

# wait_ready URL N: until the router at URL answers /ready and lists N instances
wait_ready() {
    local url=$1 want=$2 i
    for i in $(seq 1 240); do
        if curl -fsS "$url/ready" >/dev/null 2>&1 &&
            [ "$(curl -fsS "$url/v1/instances" | grep -o '"id"' | wc -l)" -ge "$want" ]; then
            return 0
        fi
        sleep 0.5
    done
    echo "not ready: $url" >&2
    return 1
}

# ask URL: one completion, printed
ask() {
    curl -fsS "$1/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\": \"$(basename "$MODEL")\", \"prompt\": \"Hello from pdserve\", \"max_tokens\": 8, \"temperature\": 0}"
    echo
}

# serve URL: keep running until Ctrl-C, unless ONESHOT=1 (then stop what was started now)
serve() {
    [ "${ONESHOT:-0}" = 1 ] && return 0
    echo "serving at $1/v1 - Ctrl-C stops what this script started"
    wait
}
