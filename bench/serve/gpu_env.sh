# Sourced at the start of a device call on the GPU machine: the vLLM 0.26 bundle on PYTHONPATH (extracted from
# /tmp/stage/part.00, staged by the previous call with .vllm_bundle/p1 carried, plus .vllm_bundle/p2 carried in this
# one; kept in /tmp/site while the machine stays warm), the NCCL/vLLM environment of shared/device/README.md, and
# this checkout installed (-e). Returns non-zero with a message when the bundle is missing.
#   source bench/serve/gpu_env.sh && python3 -m bench.serve.step_profile ...
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
_bdlora_gpu_env() {
  if [ ! -d /tmp/site/vllm ]; then
    test -f /tmp/stage/part.00 || { echo "no /tmp/stage/part.00: run the staging call (carry .vllm_bundle/p1) first"; return 3; }
    test -f .vllm_bundle/p2/part.01 || { echo "carry .vllm_bundle/p2 in this call"; return 3; }
    cat /tmp/stage/part.00 .vllm_bundle/p2/part.01 > /tmp/bundle.tar.xz && sha256sum -c .vllm_bundle/p2/SHA256SUM \
      && mkdir -p /tmp/site && tar -xJf /tmp/bundle.tar.xz -C /tmp/site && rm -f /tmp/bundle.tar.xz || return 4
    echo "vLLM bundle extracted"
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; return 5; }
}
_bdlora_gpu_env
