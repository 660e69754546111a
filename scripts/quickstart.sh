#!/usr/bin/env bash
# Sets up the environment (idempotent), then fine-tunes a BD-LoRA adapter on SmolLM2-135M-Instruct,
# compares base vs adapted accuracy, saves the PEFT folder and serves it through the vLLM plugin.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec python -m bdlora.train.quickstart "$@"
