#!/usr/bin/env bash
# Device calls 1 and 2 (2 H200s; carry .vllm_bundle/p1, then .vllm_bundle/p2): stage the vLLM bundle's first parts.
mkdir -p /tmp/stage && cp .vllm_bundle/p*/part.* /tmp/stage/ && ls -la /tmp/stage && nvidia-smi -L
