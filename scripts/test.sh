#!/usr/bin/env bash
# Sets up the environment (idempotent) and runs the whole test suite on CPU, one pytest-xdist worker per core
# (BDLORA_TEST_WORKERS overrides: 0 runs in this process), a module per worker in the order tests/conftest.py
# collects them (the longest first). Extra args go to pytest.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec python -m pytest -ra --durations=20 -n "${BDLORA_TEST_WORKERS:-auto}" --dist loadfile --no-loadscope-reorder "$@"
