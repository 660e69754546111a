#!/usr/bin/env bash
# Device call 4 (the same machine, warm, right after call 3; no carry): batch 16 with four adapters, TP=4's r40
# without the override rows, vLLM's LoRA at TP=4 batch 1 on this machine, and the GPU parity with max_rank
# (--max-lora-rank 32, max_rank 20: buffers of rank 24) in eager and CUDA-graph mode.
set -u
source bench/serve/gpu_env.sh || exit 1
bash bench/serve/profile_gpus.sh "$1" \
  'tp4 16 base bd r40t@{"max_rank":38}={"gemm_shapes":[[4096,1536,160,32,16,32,1],[4096,1536,160,128,32,64,4],[1024,4096,160,32,16,32,1],[1024,4096,160,128,32,64,2],[3584,4096,160,32,16,32,1],[3584,4096,160,128,32,64,4],[4096,7168,160,16,16,32,1],[4096,7168,160,32,32,64,4],[4096,7168,160,64,64,64,4],[4096,7168,160,128,32,64,4]]}' \
  'tp8 16 base bd r24@{"max_rank":19}' \
  'tp4 64 r40@{"max_rank":38} ; tp4:1 1 lora' \
  '! python3 bench/serve/gpu_parity.py --tp 1 --auto --max-lora-rank 32 --bd-options "{\"max_rank\": 20}" --out $RUN_DIR/parity_r24.json'
