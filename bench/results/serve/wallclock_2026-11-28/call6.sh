#!/usr/bin/env bash
# Device call 6 (2 H200s, restaged with p1-p3; the session's last 343 s): batch 1 in wall clock, one adapter, 128-token
# prompts: no LoRA and bd (--enable-bdlora alone), decode ms per step and step_ms; TP=4 on GPU 0, TP=8 on GPU 1, one
# turn folder for the four engines, 3 rounds. Results straight into OUT (the device's limit may cut the call short).
set -u
out=$1
source bench/serve/gpu_env.sh || exit 1
turns=$(mktemp -d)
export PROXY_ARGS="--batches 1 --ttft="
CUDA_VISIBLE_DEVICES=0 RR_DIR=$turns RR_FIRST=0 RR_TOTAL=4 timeout 280 bash bench/serve/auto_proxy_rr.sh tp4 $out 3 0.4 \
  base=base bd=bd > /tmp/gpu0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 RR_DIR=$turns RR_FIRST=2 RR_TOTAL=4 timeout 280 bash bench/serve/auto_proxy_rr.sh tp8 $out 3 0.4 \
  base=base bd=bd > /tmp/gpu1.txt 2>&1 &
wait
python3 -m bench.serve.report --rr $out 2>&1 | tail -20
