#!/usr/bin/env bash
# Step profiles on a machine of several GPUs: argument i is GPU i's list of runs, each run
# "SHAPE[:ADAPTERS] BATCH CONFIG..." as bench/serve/side_defer_profile.sh takes them (ADAPTERS: 4 unless given),
# runs separated by ';' (JSON without spaces). The GPUs' lists run at the same time, each list one engine after
# another on its own GPU, with its own vLLM / Triton caches (engines compiling at once never share a cache
# folder). GPU busy per step is measured per GPU, so engines on other GPUs do not enter it; the host's cores are
# shared. After `source bench/serve/gpu_env.sh`:
#   bash bench/serve/profile_gpus.sh OUT "tp8 1 base bd ; tp8 16 bd" "tp4 1 base bd" ...
# A run that starts with '!' is a shell command instead, run as written on that GPU with RUN_DIR set to the GPU's
# folder (e.g. "! python3 bench/kernels/bench_serving_kernels.py --out \$RUN_DIR/k.json"); its output goes to
# RUN_DIR/cmdK.log and its exit status into the summary, so kernel sweeps and parity runs share the call (join
# its steps with &&: ; separates runs).
# Writes, as each run finishes (so a call cut off at its time limit still returns the runs done): OUT/gpuI.tar.gz
# (folder gpuI/: GPU i's runs' json and log, and summary.txt, one line per run); at the end OUT/summary.txt (all
# GPUs' lines). So OUT holds one file per GPU plus one: the device tool brings back at most 8 files (4 GPUs with a
# summary file each beside their archives was 9, and nothing past the 8th came back).
set -u
out=$1
shift
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$#" -le "$gpus" ] || { echo "profile_gpus.sh: $# lists for $gpus GPUs (one list per GPU)"; exit 2; }
work=$(mktemp -d)
mkdir -p "$out"
# GPU i's folder packed into OUT after each run (written aside, then renamed: never a half-written archive)
pack() { tar czf "$out/.gpu$1.tar.gz" -C "$work" "gpu$1" && mv "$out/.gpu$1.tar.gz" "$out/gpu$1.tar.gz"; }
i=0
for list in "$@"; do
  mkdir -p "$work/gpu$i"
  (
    export CUDA_VISIBLE_DEVICES=$i VLLM_CACHE_ROOT=/tmp/vllm-cache-gpu$i TRITON_CACHE_DIR=/tmp/triton-cache-gpu$i
    IFS=';' read -ra runs <<< "$list"
    k=0
    for run in "${runs[@]}"; do
      if [[ $run =~ ^[[:space:]]*! ]]; then
        k=$((k + 1))
        RUN_DIR=$work/gpu$i bash -c "${run#*!}" > "$work/gpu$i/cmd$k.log" 2>&1
        echo "gpu$i cmd$k rc=$? ${run#*!}"; tail -3 "$work/gpu$i/cmd$k.log" | sed "s/^/gpu$i   /"
        pack $i
        continue
      fi
      read -ra words <<< "$run"
      [ ${#words[@]} -ge 3 ] || continue
      shape=${words[0]%%:*} adapters=4
      [[ ${words[0]} == *:* ]] && adapters=${words[0]#*:}
      for cfg in "${words[@]:2}"; do  # one engine at a time, packed as it finishes
        ADAPTERS=$adapters bash "$(dirname "$0")/side_defer_profile.sh" "$shape" "${words[1]}" "$work/gpu$i" "$cfg" \
          | sed "s/^/gpu$i /"
        pack $i
      done
    done
  ) > "$work/gpu$i/summary.txt" 2>&1 &
  i=$((i + 1))
done
wait
for ((i = 0; i < $#; i++)); do pack $i; cat "$work/gpu$i/summary.txt"; done | tee "$out/summary.txt"
rm -rf "$work"
