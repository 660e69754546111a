#!/usr/bin/env bash
# Device call 4 (2 H200s; carry .vllm_bundle/p3 after calls 1 and 2 staged p1 and p2): served at batch 16, four
# adapters (requests cycling over them), GPU busy per decode step without the prefill (decode_busy_per_step_ms):
# no LoRA, bd (the H200 table as committed), srt (the same with gemm_sorted and call 1's sorted tiles: 16 x 64 on
# 4 warps to 128 tokens, gate_up and down 32 x 64 above 64), vLLM's LoRA (r64).
set -u
source bench/serve/gpu_env.sh || exit 1
SRT='{"gemm_sorted":true,"gemm_shapes":[[4096,7168,256,64,16,64,4],[4096,7168,256,128,32,64,4],[3584,4096,256,64,16,64,4],[3584,4096,256,128,32,64,4]]}'
bash bench/serve/profile_gpus.sh "$1" "tp4 16 base bd srt=$SRT lora" "tp8 16 base bd srt=$SRT lora"
