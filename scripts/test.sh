#!/usr/bin/env bash
# Sets up the environment (idempotent) and runs the whole test suite on CPU. Extra args go to pytest.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec python -m pytest -ra "$@"
