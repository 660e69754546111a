#!/usr/bin/env bash
# Device call 3 (4 GPUs; carry .vllm_bundle/p3 after calls 1 and 2 staged p1 and p2): served, GPU busy per decode
# step, 64 steps (bench/serve/step_profile.py through profile_gpus.sh). r40 / r24: the bd engine with
# additional_config bdlora.max_rank at the adapters' rank (38 at TP=4, 19 at TP=8: buffers of 40 and 24 rows,
# not 64 and 32); r40t: the same with the H100's four-slot gemm_shapes rows at min_slot_rows 160 (4 slots x 40).
set -u
source bench/serve/gpu_env.sh || exit 1
bash bench/serve/profile_gpus.sh "$1" \
  'tp4:1 1 base bd r40@{"max_rank":38}' \
  'tp8:1 1 base bd r24@{"max_rank":19}' \
  'tp4 64 base bd r40t@{"max_rank":38}={"gemm_shapes":[[4096,1536,160,32,16,32,1],[4096,1536,160,128,32,64,4],[1024,4096,160,32,16,32,1],[1024,4096,160,128,32,64,2],[3584,4096,160,32,16,32,1],[3584,4096,160,128,32,64,4],[4096,7168,160,16,16,32,1],[4096,7168,160,32,32,64,4],[4096,7168,160,64,64,64,4],[4096,7168,160,128,32,64,4]]}' \
  'tp8 64 base bd r24@{"max_rank":19}'
