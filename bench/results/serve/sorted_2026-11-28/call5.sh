#!/usr/bin/env bash
# Device call 5 (the same 2 H200s, warm; carries .vllm_bundle/p3): GPU parity through the sorted tiled kernel:
# tiny Llama, TP=1, --enable-bdlora with the tuning override {"gemm_sorted": true} (max_loras = adapters + 1),
# eager and CUDA-graph mode, against HF + PEFT.
source bench/serve/gpu_env.sh && mkdir -p $OUT && timeout 400 python3 bench/serve/gpu_parity.py --tp 1 --auto \
  --auto-tuning '{"gemm_sorted":true}' --out $OUT/parity_sorted.json > $OUT/parity_sorted.log 2>&1; echo rc=$?
