#!/bin/bash
# Wheels the lent GPU machines lack (their image has torch 2.11, transformers, peft, accelerate, pyarrow and pandas,
# no network): built here, carried, installed there without dependencies.
#
#   bash bench/gpu_wheels.sh build      # here: .gpu_wheels/ (liger-kernel, datasets and the three packages of its
#                                       # own it needs, 2.4 MB) and .gpu_wheels_bnb/p1, p2 (bitsandbytes, 41 MiB in
#                                       # two parts); both folders are git-ignored, so `carry` can name them
#   bash bench/gpu_wheels.sh install    # there, in the checkout: the carried .gpu_wheels/, and bitsandbytes when its
#                                       # parts are there (staged in /tmp/bnbstage by an earlier call and/or carried)
#
# bitsandbytes is needed only for 4-bit runs; it does not fit one call beside two quality-bundle parts: carry
# .gpu_wheels_bnb/p1 with one call (stage it: `mkdir -p /tmp/bnbstage && cp .gpu_wheels_bnb/p1/part.* /tmp/bnbstage/`)
# and .gpu_wheels_bnb/p2 with the next, back to back, then `install`.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/bundle_parts.sh
PY=${PYTHON:-python3}
# the GPU image's Python
TARGET=(--python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64)
BNB=bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl

case "${1:-}" in
  build)
    version() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
    rm -rf .gpu_wheels && mkdir -p .gpu_wheels
    $PY -m pip download -q --no-deps "${TARGET[@]}" -d .gpu_wheels "liger-kernel==$(version liger-kernel)" \
      "datasets==$(version datasets)" "dill==$(version dill)" "multiprocess==$(version multiprocess)" \
      "xxhash==$(version xxhash)" "fsspec==$(version fsspec)"
    tmp=$(mktemp -d)
    $PY -m pip download -q --no-deps "${TARGET[@]}" -d "$tmp" bitsandbytes==0.50.2
    BUNDLE_PART_SIZE=21M split_bundle "$tmp/$BNB" .gpu_wheels_bnb "/tmp/$BNB"
    rm -rf "$tmp"
    ls -l .gpu_wheels .gpu_wheels_bnb/p*
    ;;
  install)
    $PY -m pip install -q --no-deps --force-reinstall .gpu_wheels/*.whl
    if ls .gpu_wheels_bnb/p*/SHA256SUM >/dev/null 2>&1; then
      join_bundle /tmp/bnbstage .gpu_wheels_bnb "/tmp/$BNB" && $PY -m pip install -q --no-deps "/tmp/$BNB"
    fi
    $PY -m pip install -q --no-deps --no-build-isolation -e .
    $PY -c "import datasets, liger_kernel, bdlora; print('datasets', datasets.__version__)"
    ;;
  *) sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"; exit 2 ;;
esac
