#!/usr/bin/env bash
# Create .venv with vfsdp installed in editable mode. `bash scripts/setup.sh dev` adds the test and
# documentation tools (the dev and docs extras).
#
# torch: if the venv has no torch >= 2.13 yet, install torch==2.13.0 first. On machines that
# carry a local CPU wheel (pip find-links) that is what pip takes, in seconds; elsewhere pip
# takes PyPI's default build (CUDA on Linux x86_64). Set TORCH_SPEC to choose another build,
# e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
python3 -m venv .venv
py=.venv/bin/python
if ! "$py" - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 13) else 1)
PY
then
  # shellcheck disable=SC2086
  "$py" -m pip install --quiet ${TORCH_SPEC:-torch==2.13.0}
fi
if [ "$extra" = "dev" ]; then
  "$py" -m pip install --quiet -e ".[dev,docs]"
else
  "$py" -m pip install --quiet -e ".[viz]"
fi
"$py" -c "import torch, vfsdp; print(f'vfsdp {vfsdp.__version__} with torch {torch.__version__} in .venv')"
