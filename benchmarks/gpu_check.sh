#!/usr/bin/env bash
# The one device check of pdserve's CUDA platform, run on the GPU machine from the repository root
# (one NVIDIA GPU, PyTorch with CUDA, no package registry): at most 7.5 minutes, kill grace included.
#
#   bash benchmarks/gpu_fetch_wheels.sh      # here, once: the wheels the GPU machine lacks, into .whl/
#   bash benchmarks/gpu_check.sh             # there (carry .whl); results in $OUT (default ./gpu-out)
#   bash benchmarks/gpu_check.sh --device cpu   # the dry run here: every step on this machine's CPU
#
# Steps, each under its own time limit (then SIGTERM, and SIGKILL GRACE_S later); a failed step is
# recorded and the next one runs, except the first two: nothing can run without them. The exit
# status is 1 when any step failed.
#   1. smoke: install the carried wheels into ./.site (pip --no-index --no-deps; PYTHONPATH=.site:.),
#      then benchmarks/gpu_smoke.py: every pdserve module imports (the CPU platform's excused: no
#      Paddle there), every dependency at a version pyproject.toml allows, every carried wheel at
#      its pinned version with its own requirements met. Fails fast, naming what is wrong.
#   2. facts: nvidia-smi, Python, torch, CUDA, the GPU; fails without a usable GPU
#   3. pytest: python3 -m pytest -q -m gpu on tests/gpu and every test file marked gpu
#   4. bench: benchmarks/gpu_bench.py: the card's measured copy bandwidth and GEMM rate, pdserve's
#      speed against the bounds they give (llama3-8b, then smollm2-135m), the cuda_ipc hand-off,
#      exactness, the HF transformers eager reference last; its JSON rewritten as each cell ends
#   5. serve: benchmarks/gpu_serve_check.py: pdserve up --device cuda, mixed vs 1 prefill + 1 decode
#      on the one GPU (greedy text equal), pdserve bench through the router
# Files in $OUT (at most 8, as the device tool brings back): check.log (this output), pytest.log,
# gpu_bench.json, gpu_bench.log, gpu_serve.json, gpu_serve.log, gpu_serve_bench.json. The JSON files
# are rewritten as the steps go: a run killed at any point keeps what it had measured.
#
# Limits (seconds) from the environment: GPU_CHECK_SMOKE_S (30), GPU_CHECK_FACTS_S (15),
# GPU_CHECK_PYTEST_S (120), GPU_CHECK_BENCH_S (180), GPU_CHECK_SERVE_S (80), GPU_CHECK_GRACE_S (5);
# the steps' limits and graces may add up to GPU_CHECK_TOTAL_S (450) at most, checked before
# anything runs. GPU_CHECK_STEPS (smoke,facts,pytest,bench,serve) picks steps, e.g.
# GPU_CHECK_STEPS=smoke,facts,bench for a second try of one; GPU_BENCH_ARGS, GPU_SERVE_ARGS add
# flags; GPU_TESTS replaces the test paths; PYTHON is the interpreter (python3; --device cpu: .venv's).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=cuda
case "${1:-}" in
    --device)
        DEVICE=${2:?--device cpu or cuda}
        ;;
    -h | --help)
        awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"  # the header above
        exit 0
        ;;
    "") ;;
    *)
        echo "unknown argument: $1 (see --help)" >&2
        exit 2
        ;;
esac
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"

SMOKE_S=${GPU_CHECK_SMOKE_S:-30}
FACTS_S=${GPU_CHECK_FACTS_S:-15}
PYTEST_S=${GPU_CHECK_PYTEST_S:-120}
BENCH_S=${GPU_CHECK_BENCH_S:-180}
SERVE_S=${GPU_CHECK_SERVE_S:-80}
GRACE_S=${GPU_CHECK_GRACE_S:-5}
TOTAL_S=${GPU_CHECK_TOTAL_S:-450}
STEPS=",${GPU_CHECK_STEPS:-smoke,facts,pytest,bench,serve},"
BENCH_ARGS=${GPU_BENCH_ARGS:-}
SERVE_ARGS=${GPU_SERVE_ARGS:-}
if [ "$DEVICE" = cpu ]; then
    # the dry run: this machine's venv has every package (no wheels to install); the serve check's
    # stacks run the CPU engine on the tiny preset, with a short bench
    PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
    SERVE_ARGS="--preset tiny --bench-prompts 8 --bench-input-len 32 --bench-output-len 8 $SERVE_ARGS"
else
    PYTHON=${PYTHON:-python3}
    export PYTHONPATH="$ROOT/.site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export OUT ROOT DEVICE PYTHON

# the steps' limits and kill graces add up to at most TOTAL_S: the device tool's limit, the session's
# device minutes and the promise above count on it
planned=0
for name in smoke facts pytest bench serve; do
    [[ $STEPS == *",$name,"* ]] || continue
    limit_var="${name^^}_S"
    planned=$((planned + ${!limit_var} + GRACE_S))
done
if [ $planned -gt "$TOTAL_S" ]; then
    echo "gpu_check: the steps' limits and kill graces add up to ${planned} s, over GPU_CHECK_TOTAL_S (${TOTAL_S} s)" >&2
    exit 2
fi

T0=$(date +%s)
declare -a SUMMARY=()
FAILED=0

# step NAME LIMIT_S CMD...: run CMD under `timeout`, record its status and time; returns CMD's status
step() {
    local name=$1 limit=$2
    shift 2
    local t
    t=$(date +%s)
    echo
    echo "===== $name (limit ${limit} s, at $(($(date +%s) - T0)) s) ====="
    # a shell function runs in a child bash (exported below): `timeout` runs programs only
    timeout -k "$GRACE_S" "$limit" bash -c '"$@"' step "$@"
    local rc=$?
    local took=$(($(date +%s) - t))
    local status=ok
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status="TIMEOUT"
    elif [ $rc -ne 0 ]; then
        status="FAILED (rc $rc)"
    fi
    [ "$status" = ok ] || FAILED=1
    SUMMARY+=("$(printf '%-8s %-16s %4d s of %4d' "$name" "$status" "$took" "$limit")")
    echo "===== $name: $status in ${took} s ====="
    return $rc
}

smoke() {
    if [ "$DEVICE" = cuda ]; then
        shopt -s nullglob
        local wheels=(.whl/*.whl)
        if [ ${#wheels[@]} -eq 0 ]; then
            echo "no wheels in .whl/ (run benchmarks/gpu_fetch_wheels.sh here and carry .whl)"
            return 1
        fi
        rm -rf "$ROOT/.site"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$ROOT/.site" "${wheels[@]}" \
            || return 1
        echo "installed ${#wheels[@]} wheels into .site"
    fi
    "$PYTHON" benchmarks/gpu_smoke.py --device "$DEVICE"
}

facts() {
    if [ "$DEVICE" = cuda ]; then
        nvidia-smi || echo "nvidia-smi failed"
        nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm,clocks.mem \
            --format=csv || true
    fi
    "$PYTHON" - <<'EOF'
import os, platform, sys
print("python", sys.version.split()[0], platform.machine())
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"{p.multi_processor_count} SMs",
          f"capability {p.major}.{p.minor}", f"{torch.cuda.device_count()} device(s)")
from pdserve.engine.platform import cuda_unavailable
reason = cuda_unavailable()
print("pdserve's cuda platform:", reason or "usable")
# a GPU check without a usable GPU has failed (the tests would all skip); the dry run expects none
sys.exit(1 if reason and os.environ["DEVICE"] == "cuda" else 0)
EOF
}

gpu_tests() {
    local paths
    if [ -n "${GPU_TESTS:-}" ]; then
        paths=$GPU_TESTS
    else
        # tests/gpu plus files elsewhere marked gpu: collecting all of tests/ would import Paddle's
        # test modules, which the GPU machine cannot (collection errors fail the run)
        paths="tests/gpu $(grep -rlE 'mark\.gpu\b' tests --include='test_*.py' | grep -v '^tests/gpu/' | sort | tr '\n' ' ')"
    fi
    echo "pytest -m gpu $paths"
    # shellcheck disable=SC2086
    "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider $paths >"$OUT/pytest.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/pytest.log"
    return $rc
}

export -f smoke facts gpu_tests

main() {
    echo "gpu_check --device $DEVICE: steps ${STEPS:1:-1}, limits + graces ${planned} s of ${TOTAL_S}; results in $OUT"
    if ! step smoke "$SMOKE_S" smoke; then
        echo "gpu_check: FAILED at smoke: pdserve cannot run from this Python with these wheels (above)"
        printf '%s\n' "${SUMMARY[@]}"
        return 1
    fi
    if [[ $STEPS == *",facts,"* ]] && ! step facts "$FACTS_S" facts; then
        echo "gpu_check: FAILED at facts: no usable GPU, so nothing else can run"
        printf '%s\n' "${SUMMARY[@]}"
        return 1
    fi
    [[ $STEPS == *",pytest,"* ]] && step pytest "$PYTEST_S" gpu_tests
    # each Python step is told its own limit less a margin, and ends itself before `timeout` must
    # shellcheck disable=SC2086
    [[ $STEPS == *",bench,"* ]] && step bench "$BENCH_S" "$PYTHON" benchmarks/gpu_bench.py --device "$DEVICE" \
        --out "$OUT/gpu_bench.json" --budget-s $((BENCH_S - 8)) $BENCH_ARGS
    # shellcheck disable=SC2086
    [[ $STEPS == *",serve,"* ]] && step serve "$SERVE_S" "$PYTHON" benchmarks/gpu_serve_check.py --device "$DEVICE" \
        --out "$OUT/gpu_serve.json" --deadline-s $((SERVE_S - 8)) $SERVE_ARGS

    echo
    [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=memory.used,temperature.gpu,clocks.sm --format=csv 2>/dev/null
    echo
    echo "===== gpu_check summary ($(($(date +%s) - T0)) s; results in $OUT) ====="
    printf '%s\n' "${SUMMARY[@]}"
    if [ $FAILED -ne 0 ]; then
        echo "gpu_check: FAILED"
        return 1
    fi
    echo "gpu_check: ok"
}

# the whole output also into check.log (a pipe, not exec > >(tee): the file is complete when we exit)
main 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
