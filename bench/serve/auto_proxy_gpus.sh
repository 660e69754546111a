#!/usr/bin/env bash
# auto_proxy_rr.sh on several GPUs of one machine, all their engines measuring in turns with each other (one turn
# folder): each GPU starts its engines one after another, and nobody measures until every engine on every GPU is
# up, so no engine measures while another compiles or measures (wall-clock A/B runs without a busy host). List k
# runs on GPU k with its own vLLM / Triton caches; each list is "SHAPE ENGINE..." with ENGINE as auto_proxy_rr.sh
# takes it (JSON without spaces); PROXY_ARGS applies to every engine. After `source bench/serve/gpu_env.sh`:
#   PROXY_ARGS="--adapters 4 --batches 16,64" bash bench/serve/auto_proxy_gpus.sh OUT ROUNDS MEM \
#     "tp4 base=base bd=bd" "tp8 base=base bd=bd"
# Results as auto_proxy_rr.sh's (OUT/rr_SHAPE_LABEL.json and .log; each json rewritten after every round), the
# GPUs' own output in OUT/gpuK.txt. Exits 1 when any GPU's call fails (an engine that fails stops all of them).
set -u
out=$1 rounds=$2 mem=$3
shift 3
if command -v nvidia-smi > /dev/null; then  # (without it: CPU engines, all lists on the host)
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$#" -le "$gpus" ] || { echo "auto_proxy_gpus.sh: $# lists for $gpus GPUs (one list per GPU)" >&2; exit 2; }
fi
turns=$(mktemp -d)
trap 'rm -rf "$turns"' EXIT
mkdir -p "$out"
total=0
for list in "$@"; do
  read -ra words <<< "$list"
  total=$((total + ${#words[@]} - 1))
done
first=0 k=0 pids=()
for list in "$@"; do
  read -ra words <<< "$list"
  CUDA_VISIBLE_DEVICES=$k VLLM_CACHE_ROOT=/tmp/vllm-cache-gpu$k TRITON_CACHE_DIR=/tmp/triton-cache-gpu$k \
    RR_DIR=$turns RR_FIRST=$first RR_TOTAL=$total \
    bash "$(dirname "$0")/auto_proxy_rr.sh" "${words[0]}" "$out" "$rounds" "$mem" "${words[@]:1}" \
    > "$out/gpu$k.txt" 2>&1 &
  pids+=($!)
  first=$((first + ${#words[@]} - 1)) k=$((k + 1))
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
