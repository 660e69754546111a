#!/bin/bash
# vLLM's MoE ops for the GPU bundle, which leaves them out (a dense Llama never loads them): MoE serving runs
# (bench.serve.moe_parity, moe_proxy) need vllm/_moe_C_stable_libtorch.abi3.so of the same wheel.
#
#   bash bench/serve/moe_ops_part.sh [.vllm_bundle]    # here, after shared/device/build_vllm_bundle.sh (~40 MB)
#
# Then one device call of its own carries .vllm_bundle/moe and runs
#   mkdir -p /tmp/moe && tar -xJf .vllm_bundle/moe/moe_C.tar.xz -C /tmp/moe
# and bench/serve/gpu_env.sh copies the library into the extracted bundle.
set -euo pipefail
B=${1:-.vllm_bundle}
WHEEL=$(ls "$B"/whl/vllm-*.whl 2>/dev/null | head -1 || true)
[ -n "$WHEEL" ] || {
  echo "no vLLM wheel in $B/whl: build the bundle first (shared/device/build_vllm_bundle.sh $B)"; exit 3; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' "$WHEEL" \
  vllm/_moe_C_stable_libtorch.abi3.so "$T" 2>/dev/null \
  || { echo "$WHEEL has no vllm/_moe_C_stable_libtorch.abi3.so"; exit 4; }
mkdir -p "$B/moe"
tar -C "$T" -cf - vllm | xz -9 -T0 > "$B/moe/moe_C.tar.xz.tmp"
mv "$B/moe/moe_C.tar.xz.tmp" "$B/moe/moe_C.tar.xz"
ls -l "$B/moe/moe_C.tar.xz"
