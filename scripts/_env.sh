# Sourced by scripts/*.sh: set up the environment (idempotent), activate it, cd to the repository root, and set
# the CPU defaults every entry point needs.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
# shellcheck disable=SC1091
. "${BDLORA_VENV:-$root/.venv}/bin/activate"
cd "$root"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
