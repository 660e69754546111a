#!/bin/bash
# MoE proxy engines (bench/serve/moe_proxy.py), one per GPU at the same time, then the table of all of them.
#
#   source bench/serve/gpu_env.sh && bash bench/serve/moe_proxy_run.sh tp4:lora tp4:bd tp4:base tp4:share
#
# Each argument TP:ENGINE runs `python3 -m bench.serve.moe_proxy --tp TP --only ENGINE` on a GPU of its own, as many
# at once as there are GPUs (MOE_PROXY_GPUS, default every GPU nvidia-smi lists; more arguments than GPUs run in
# turns), each stopped after MOE_PROXY_LIMIT_S seconds (default 280; the rows it wrote by then are kept: an engine
# takes ~85 s to start and ~35 s per batch size). MOE_PROXY_MEM: gpu_memory_utilization (default 0.8, one engine per
# GPU); MOE_PROXY_ARGS: more moe_proxy arguments for every engine (e.g. "--batches 1,8" or, on CPU, "--shape tiny
# --prepare-only"). Writes $OUT/moe_proxy/tpTP-ENGINE.{json,log} and table.md (from every JSON in that folder, so
# later calls on a warm machine add to it).
#
# wTP:ENGINE (e.g. w2:fully) serves the whole model at TP on the first TP GPUs (--whole-model), one such engine at a
# time after the per-GPU ones: ENGINE one of base lora bd fully. Writes $OUT/moe_proxy/whole-tpTP-ENGINE.{json,log}.
set -uo pipefail
O=${OUT:-/tmp/out}/moe_proxy
mkdir -p "$O"
if [ -n "${MOE_PROXY_GPUS:-}" ]; then read -r -a GPUS <<< "$(echo "$MOE_PROXY_GPUS" | tr ',' ' ')"
else read -r -a GPUS <<< "$(nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' ')"; fi
[ "${#GPUS[@]}" -gt 0 ] || { echo "no GPU to run on (set MOE_PROXY_GPUS)"; exit 6; }
[ $# -gt 0 ] || { echo "usage: bash bench/serve/moe_proxy_run.sh TP:ENGINE|wTP:ENGINE ... (ENGINE: base lora bd share; w: base lora bd fully)"; exit 2; }
SHARDS=() WHOLE=()
for spec in "$@"; do
  if [[ "$spec" =~ ^[0-9]+:(base|lora|bd|share)$ ]]; then SHARDS+=("$spec")
  elif [[ "$spec" =~ ^w[0-9]+:(base|lora|bd|fully)$ ]]; then WHOLE+=("${spec#w}")
  else echo "$spec: give TP:ENGINE (ENGINE one of base lora bd share, e.g. 4:bd) or wTP:ENGINE (the whole model on TP GPUs, ENGINE one of base lora bd fully, e.g. w2:fully)"; exit 2
  fi
done
run_one() {  # GPUS TP ENGINE [--whole-model]
  local name="tp$2-$3"
  [ -n "${4:-}" ] && name="whole-$name"
  echo "[moe-proxy] $name on GPU $1"
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "${MOE_PROXY_LIMIT_S:-280}" python3 -m bench.serve.moe_proxy --tp "$2" \
    --only "$3" --mem "${MOE_PROXY_MEM:-0.8}" --root "/tmp/bdlora-moe-proxy-$name" --out "$O/$name.json" ${4:-} \
    ${MOE_PROXY_ARGS:-} > "$O/$name.log" 2>&1
  local rc=$? rows
  rows=$(grep -c '"batch"' "$O/$name.json" 2>/dev/null)
  echo "[moe-proxy] $name exited $rc (${rows:-0} batch rows)"
}
set -- "${SHARDS[@]}"
while [ $# -gt 0 ]; do
  for gpu in "${GPUS[@]}"; do
    [ $# -gt 0 ] || break
    run_one "$gpu" "${1%%:*}" "${1##*:}" &
    shift
  done
  wait
done
for spec in "${WHOLE[@]}"; do
  tp=${spec%%:*}
  [ "$tp" -le "${#GPUS[@]}" ] || { echo "[moe-proxy] w$spec needs $tp GPUs, ${#GPUS[@]} listed: skipped"; continue; }
  run_one "$(IFS=,; echo "${GPUS[*]:0:$tp}")" "$tp" "${spec##*:}" --whole-model
done
ls "$O"/*tp*.json >/dev/null 2>&1 && python3 -m bench.serve.moe_proxy report "$O"/*tp*.json --out "$O/table.md"
