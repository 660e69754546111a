# Sourced at the start of a device call on the GPU machine: the vLLM 0.26 bundle on PYTHONPATH (extracted from its
# parts, bench/bundle_parts.sh: the first ones staged into /tmp/stage by earlier calls, each carrying one
# .vllm_bundle/pK and running `mkdir -p /tmp/stage && cp .vllm_bundle/p*/part.* /tmp/stage/`, the last one carried
# in this call; kept in /tmp/site while the machine stays warm),
# the NCCL/vLLM environment of shared/device/README.md, and this checkout installed (-e). Returns non-zero with a
# message when a part is missing.
#   source bench/serve/gpu_env.sh && python3 -m bench.serve.step_profile ...
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
_bdlora_gpu_env() {
  if [ ! -d /tmp/site/vllm ]; then
    source "$(dirname "${BASH_SOURCE[0]}")/../bundle_parts.sh" && join_bundle /tmp/stage .vllm_bundle /tmp/bundle.tar.xz \
      || return $?
    mkdir -p /tmp/site && tar -xJf /tmp/bundle.tar.xz -C /tmp/site && rm -f /tmp/bundle.tar.xz || return 4
    echo "vLLM bundle extracted"
  fi
  # vLLM's MoE ops, staged by a call of their own (bench/serve/moe_ops_part.sh)
  if [ -d /tmp/moe/vllm ] && [ ! -f /tmp/site/vllm/_moe_C_stable_libtorch.abi3.so ]; then
    cp /tmp/moe/vllm/*.so /tmp/site/vllm/ && echo "vLLM MoE ops added"
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; return 5; }
}
_bdlora_gpu_env
