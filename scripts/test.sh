#!/usr/bin/env bash
# Sets up the environment (idempotent) and runs the whole test suite on CPU. Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
# shellcheck disable=SC1091
. "${BDLORA_VENV:-$root/.venv}/bin/activate"
cd "$root"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec python -m pytest -ra "$@"
