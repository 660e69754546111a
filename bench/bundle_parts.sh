# Bundles (files the GPU machine needs and cannot download: the vLLM 0.26 site, the quality benchmark's model and
# data) travel to it in parts: a device call carries 64 MiB with the checkout (~8 MiB), whose results take ~27 MiB.
# Sourced here (split) and on the GPU machine (join). Parts of 26 MiB (BUNDLE_PART_SIZE), one per folder DIR/p1,
# DIR/p2, ...; the last folder also holds SHA256SUM. Two parts and the checkout fit one call: each call but the last
# carries two folders and stages their parts with
#   mkdir -p STAGE && cp DIR/p*/part.* STAGE/
# and the last call carries the rest (the last folder among them) and joins. A machine is held only while calls
# follow each other (the device tool gives it back when idle): issue the calls of one bundle back to back.

# split_bundle FILE DIR DEST: FILE in parts DIR/pK/part.NN (replacing DIR's earlier parts only); SHA256SUM names
# DEST (where join_bundle writes it)
split_bundle() {
  local file=$1 dir=$2 dest=$3 f k=1 last=""
  mkdir -p "$dir" && rm -rf "$dir"/p[0-9]* "$dir"/part.*
  split -b "${BUNDLE_PART_SIZE:-26M}" -d -a 2 "$file" "$dir/part." || return 1
  for f in "$dir"/part.*; do
    mkdir -p "$dir/p$k" && mv "$f" "$dir/p$k/" && last="$dir/p$k" && k=$((k + 1))
  done
  echo "$(sha256sum < "$file" | cut -d' ' -f1)  $dest" > "$last/SHA256SUM"
}

# join_bundle STAGE DIR DEST: every part once, by name, from the staged ones in STAGE and the carried ones in DIR, into
# DEST, checked against the carried SHA256SUM; non-zero with a message naming what is missing
join_bundle() {
  local stage=$1 dir=$2 dest=$3 sums parts
  sums=$(ls "$dir"/p*/SHA256SUM 2>/dev/null | head -1)
  [ -n "$sums" ] || { echo "carry the bundle's last part (the $dir/pK with SHA256SUM) in this call"; return 3; }
  parts=$(for f in "$stage"/part.* "$dir"/p*/part.*; do [ -f "$f" ] && echo "${f##*/} $f"; done \
          | sort -u -k1,1 | cut -d' ' -f2)
  if [ -z "$parts" ] || ! cat $parts > "$dest" || ! sha256sum -c --status "$sums"; then
    rm -f "$dest"
    echo "bundle parts missing or corrupt (have: $(echo $parts)): stage the others first (carry $dir/pK and run" \
         "mkdir -p $stage && cp $dir/p*/part.* $stage/)"
    return 4
  fi
}
