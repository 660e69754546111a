#!/usr/bin/env bash
# Device call 5 (the same 2 H200s, warm): IT/OT 1024/128 and TTFT. auto_proxy.py with 1024-token prompts (decode
# ms per step and step_ms at a 1024-token context, batch 16 and 64) and TTFT of 1024-token prompts at batch 1 and 16
# (prefill-only generate, min of 3), four adapters: no LoRA, vLLM's LoRA (r64) and bd (--enable-bdlora alone).
# TP=4 on GPU 0, TP=8 on GPU 1, one turn folder for the six engines, 2 rounds. Writes OUT/call5.tar.gz (r5/).
set -u
out=$1
source bench/serve/gpu_env.sh || exit 1
r=/tmp/r5 && mkdir -p $r && turns=$(mktemp -d)
export PROXY_ARGS="--adapters 4 --batches 16,64 --ttft 1,16 --prompt-len 1024"
CUDA_VISIBLE_DEVICES=0 RR_DIR=$turns RR_FIRST=0 RR_TOTAL=6 timeout 570 bash bench/serve/auto_proxy_rr.sh tp4 $r 2 0.28 \
  base=base lora=lora bd=bd > $r/gpu0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 RR_DIR=$turns RR_FIRST=3 RR_TOTAL=6 timeout 570 bash bench/serve/auto_proxy_rr.sh tp8 $r 2 0.28 \
  base=base lora=lora bd=bd > $r/gpu1.txt 2>&1 &
wait
nvidia-smi -L > $r/gpus.txt
tar czf $out/call5.tar.gz -C /tmp r5
python3 -m bench.serve.report --rr $r 2>&1 | tail -30
