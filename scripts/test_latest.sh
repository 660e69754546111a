#!/usr/bin/env bash
# The training, data, adapter-format and hub tests on the newest releases of the pure-Python libraries bdlora builds
# on (transformers, peft, trl, accelerate, datasets, huggingface_hub), in a virtual environment of their own
# (.venv-latest, or BDLORA_LATEST_VENV): what a user who upgrades them gets. pyproject.toml bounds a library only where
# a release failed here. Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${BDLORA_LATEST_VENV:-$root/.venv-latest}"
py="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q "torch==2.13.0"   # the CPU wheel on disk; everything below then finds torch satisfied
pip install -q --upgrade transformers peft trl accelerate datasets huggingface_hub safetensors pyyaml tqdm
pip install -q --upgrade pytest pytest-xdist tensorboard matplotlib
pip install -q --no-deps -e "$root"
python - <<'PY'
from importlib.metadata import version
print("newest releases:", ", ".join(f"{p} {version(p)}" for p in
      ("transformers", "peft", "trl", "accelerate", "datasets", "huggingface_hub")))
PY
cd "$root"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec python -m pytest -ra -n "${BDLORA_TEST_WORKERS:-auto}" -p no:cacheprovider tests/test_train_config.py tests/test_train_output_dir.py \
  tests/test_train_resume.py tests/test_train_equivalence.py tests/test_train_data.py tests/test_train_data_formats.py \
  tests/test_train_inputs.py tests/test_train_dp.py tests/test_trl_example.py tests/test_adapter_format.py \
  tests/test_spec.py tests/test_convert.py tests/test_hub.py tests/test_docs.py tests/test_peft_kernel_variant.py \
  tests/test_moe.py tests/test_packed_attention.py tests/test_engine_run.py "$@"
