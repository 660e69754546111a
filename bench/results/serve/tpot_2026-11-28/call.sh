#!/usr/bin/env bash
# Device calls 3 and 4 of 2026-11-28 (2 H200s, after staging .vllm_bundle/p1 and p2 with
# ../wallclock_2026-11-28/call1.sh; this call carries p3): IT/OT 128/1024 in wall clock, no LoRA, vLLM's LoRA (r64)
# and bd (--enable-bdlora alone), TP=8's shard on GPU 0 and TP=4's on GPU 1, all six engines in one turn folder.
# step_ms over 1024 decode steps per request (final outputs only), beside the 144 - 16 generate figure.
#   bash call.sh OUT 3 "--batches 1"                    (call 3: one adapter, 3 rounds)
#   bash call.sh OUT 4 "--batches 16,64 --adapters 4"   (call 4: four adapters, 2 rounds)
# Writes OUT/callN.tar.gz (rN/: rr_SHAPE_ENGINE.json and .log, gpuK.txt) and prints report --rr.
set -u
out=$1 n=$2 args=$3
source bench/serve/gpu_env.sh || exit 1
r=/tmp/r$n && rm -rf $r && mkdir -p $r
rounds=$([ "$n" = 3 ] && echo 3 || echo 2)
PROXY_ARGS="$args --ttft= --step-tokens 1024" timeout 560 bash bench/serve/auto_proxy_gpus.sh $r $rounds 0.28 \
  "tp8 base=base lora=lora bd=bd" "tp4 base=base lora=lora bd=bd"
echo "rc=$?"
nvidia-smi -L > $r/gpus.txt
tar czf $out/call$n.tar.gz -C /tmp r$n
python3 -m bench.serve.report --rr $r 2>&1 | tail -30
