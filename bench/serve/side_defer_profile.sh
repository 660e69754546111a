#!/usr/bin/env bash
# Step profiles (bench/serve/step_profile.py, --adapters $ADAPTERS (default 4), 64 steps) of one shard shape and
# batch, one engine per configuration, one after another, on the GPU machine after `source bench/serve/gpu_env.sh`:
#   bash bench/serve/side_defer_profile.sh SHAPE BATCH OUT CONFIG...
# CONFIG: base | bd | lora | NAME=JSON (bd with that tuning override, e.g. side_shapes rows whose defer entry is 1) |
# NAME@JSON[=JSON] (bd with those additional_config["bdlora"] settings, e.g. r40@{"max_rank":38}, and that tuning).
# Writes OUT/step_SHAPE_bBATCH_NAME_aADAPTERS.json and .log; prints GPU busy ms per step (with the prefill, and of the
# decode steps alone) and the unprofiled generate ms.
set -u
shape=$1 batch=$2 out=$3 adapters=${ADAPTERS:-4}
shift 3
mkdir -p "$out"
for cfg in "$@"; do
  case $cfg in
    base|bd|lora) name=$cfg; args=(--only "$cfg") ;;
    *@*=*) name=${cfg%%@*}; rest=${cfg#*@}; args=(--only bd --bd-options "${rest%%=*}" --tuning "${rest#*=}") ;;
    *@*) name=${cfg%%@*}; args=(--only bd --bd-options "${cfg#*@}") ;;
    *=*) name=${cfg%%=*}; args=(--only bd --tuning "${cfg#*=}") ;;
    *) echo "bad config $cfg"; exit 2 ;;
  esac
  res="$out/step_${shape}_b${batch}_${name}_a${adapters}"
  timeout 290 python3 bench/serve/step_profile.py --shape "$shape" --batch "$batch" --steps 64 --adapters "$adapters" \
    "${args[@]}" --out "$res.json" > "$res.log" 2>&1
  rc=$?
  echo "$shape b$batch a$adapters $name rc=$rc $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("busy/step", d["busy_per_step_ms"], "decode busy/step", d.get("decode_busy_per_step_ms"), "generate", d["generate_ms_unprofiled"])' "$res.json" 2>/dev/null)"
  [ $rc -eq 0 ] || tail -5 "$res.log"
done
