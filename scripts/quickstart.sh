#!/usr/bin/env bash
# Sets up the environment (idempotent), then fine-tunes a BD-LoRA adapter on SmolLM2-135M-Instruct,
# compares base vs adapted accuracy, saves the PEFT folder and serves it through the vLLM plugin.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
# shellcheck disable=SC1091
. "${BDLORA_VENV:-$root/.venv}/bin/activate"
cd "$root"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec python -m bdlora.train.quickstart "$@"
