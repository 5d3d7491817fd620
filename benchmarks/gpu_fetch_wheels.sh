#!/usr/bin/env bash
# Download into ./.whl the wheels pdserve needs on a GPU machine beyond what that machine ships (its
# image has Python 3.12, PyTorch, Triton, CuPy, numba, transformers, tokenizers, safetensors, numpy,
# huggingface-hub, httpx, uvloop, rich, prometheus-client, jinja2, tqdm, filelock, click, psutil and
# pytest, and reaches no package registry), as one consistent set: benchmarks/gpu_wheels.py resolves
# pdserve's dependencies for CPython 3.12 manylinux x86_64 in one pip run (the versions this checkout's
# .venv tested pinned), carries what the machine lacks, and writes .whl/requirements.txt.
#
#   bash benchmarks/gpu_fetch_wheels.sh              # the serving stack's wheels
#   bash benchmarks/gpu_fetch_wheels.sh --mooncake   # + mooncake-transfer-engine-non-cuda
#
# benchmarks/gpu_check.sh installs them there (pip --no-index --no-deps --target .site) and checks
# the set imports (gpu_smoke.py) before anything else. .whl/ stays out of git (/.whl/ in
# .gitignore); the working tree that travels to the GPU machine, these wheels included, must stay
# under 64 MiB (the script prints the total and fails over it).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    -h | --help)
        awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"  # the header above
        exit 0
        ;;
esac
# the checkout's venv: its pip resolves, and its installed versions are the tested pins
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
# pip's notes about this host's own find-links folders are noise here
"$PY" benchmarks/gpu_wheels.py "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
