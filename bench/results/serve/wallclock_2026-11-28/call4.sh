#!/usr/bin/env bash
# Device call 4 (the same 2 H200s, restaged with p1-p3: idle after call 3): the wall-clock A/B of tokens grouped
# by slot.
# auto_proxy.py's decode ms per step ((144-token generate - 16-token generate) / 128, unprofiled, min of 2 per round),
# four adapters (requests cycling over them), 128-token prompts, batch 16 and 64: no LoRA, bd (the H200 entry as
# committed: gemm_sorted on) and unsorted (the same with gemm_sorted off). TP=4 on GPU 0, TP=8 on GPU 1; the six
# engines share one turn folder, so none measures while another measures or compiles. 3 rounds. New beside call 3:
# step_ms, the median wall time of one engine step in steady decode (no prefill in it).
# Writes OUT/call4.tar.gz (r4/: every json and log).
bash "$(dirname "$0")/call3.sh" "$1" 4
