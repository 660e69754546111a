#!/usr/bin/env bash
# Device call 2 (the same 2 H200s, warm; carries .vllm_bundle/p2): stages the second part of the vLLM bundle.
mkdir -p /tmp/stage && cp .vllm_bundle/p*/part.* /tmp/stage/ && ls -la /tmp/stage && nvidia-smi -L
