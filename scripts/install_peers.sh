#!/usr/bin/env bash
# Optional extra: install the three peer EAGLE-3 pipelines (nvidia-modelopt, specforge,
# speculators), each into its own venv under the draftsmith cache, never into the project's
# .venv. Each venv gets the CPU torch wheel first, then the peer with --no-deps, then only the
# packages that importing its EAGLE-3 model classes needs (their full requirement lists pull in
# CUDA builds, SGLang and vLLM, none of which run here). Idempotent: a venv whose import check
# passes is left alone; a second run only prints the venvs.
#
#   bash scripts/install_peers.sh                  # all three
#   bash scripts/install_peers.sh specforge        # just one (modelopt | specforge | speculators)
#   bash scripts/install_peers.sh --train          # also what each peer's EAGLE-3 training imports
#   pytest tests/test_peer_heads.py                # uses the venvs it finds, skips the others
#   python bench/peer_training.py                  # trains with each peer (needs --train)
#
# Needs PyPI and nothing else (no Hub downloads). About a minute per peer.
set -euo pipefail
CACHE=${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}
ROOT="$CACHE/peers"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
TORCH=${PEER_TORCH:-torch==2.13.0}

# name | the peer's own release | what importing its EAGLE-3 classes needs | the import check
declare -A RELEASE=(
  [modelopt]="nvidia-modelopt==0.47.0"
  [specforge]="specforge==0.2.0"
  [speculators]="speculators==0.9.0"
)
declare -A DEPS=( # found by trying: the import check and tests/peer_worker.py, from transformers up
  [modelopt]="transformers==5.14.0 safetensors requests omegaconf pulp<4 scipy"
  [specforge]="transformers==5.8.1 safetensors datasets"
  [speculators]="transformers==5.19.0 safetensors openai datasets<=5.1.0 hs-connectors==0.9.0 loguru<=0.7.3"
)
declare -A CHECK=(
  [modelopt]="import modelopt.torch.speculative as mtsp, modelopt.torch.export.plugins.hf_spec_export"
  [specforge]="from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3; import specforge.data.preprocessing"
  [speculators]="from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig; import speculators.train.vocab_mapping"
)

# --train: what each peer's training path imports beyond its model classes (bench/peers/*_run.py drive
# it), a separate list and check so the model-class venvs stay as small as they are
declare -A TRAIN_DEPS=( # found by trying: bench/peers/*_run.py in venvs made without them
  [modelopt]="accelerate"
  [specforge]="accelerate"
  [speculators]="httpx pydantic-settings"
)
declare -A TRAIN_CHECK=(
  [modelopt]="import accelerate, transformers.trainer, modelopt.recipe, modelopt_recipes, modelopt.torch.export"
  [specforge]="import specforge.cli, specforge.application, specforge.training.trainer, accelerate.utils"
  [speculators]="import speculators.train.cli, speculators.train.trainer, speculators.train.data"
)

pip_install() { # quiet on success; pip's own output (less its notes on absent local indexes) on failure
  local venv=$1 log
  shift
  log=$(mktemp)
  if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

install_peer() {
  local name=$1 venv="$ROOT/$1"
  if [ -x "$venv/bin/python" ] && [ -f "$venv/.draftsmith-installed" ] &&
    [ "$(cat "$venv/.draftsmith-installed")" = "${RELEASE[$name]} ${DEPS[$name]}" ] &&
    "$venv/bin/python" -W ignore -c "${CHECK[$name]}" >/dev/null 2>&1; then
    echo "$name: $venv (already installed)"
    return 0
  fi
  echo "install_peers: $name -> $venv" >&2
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  pip_install "$venv" "$TORCH"
  "$venv/bin/python" -c "import torch; assert not torch.version.cuda, torch.version.cuda" 2>/dev/null || {
    echo "install_peers: $TORCH resolved to a CUDA build here; remove $venv and set PEER_TORCH to a CPU wheel" >&2
    exit 1
  }
  # shellcheck disable=SC2086  # the dependency list is word-split on purpose
  pip_install "$venv" ${DEPS[$name]}
  pip_install "$venv" --no-deps "${RELEASE[$name]}"
  "$venv/bin/python" -W ignore -c "${CHECK[$name]}" ||
    { echo "install_peers: $name installed but its EAGLE-3 classes do not import" >&2; exit 1; }
  echo "${RELEASE[$name]} ${DEPS[$name]}" >"$venv/.draftsmith-installed"
  echo "$name: $venv"
}

install_training() { # after install_peer; idempotent like it (its own marker, its own check)
  local name=$1 venv="$ROOT/$1"
  if [ -f "$venv/.draftsmith-train-installed" ] &&
    [ "$(cat "$venv/.draftsmith-train-installed")" = "${TRAIN_DEPS[$name]}" ] &&
    "$venv/bin/python" -W ignore -c "${TRAIN_CHECK[$name]}" >/dev/null 2>&1; then
    echo "$name: training deps (already installed)"
    return 0
  fi
  # shellcheck disable=SC2086  # the dependency list is word-split on purpose
  pip_install "$venv" ${TRAIN_DEPS[$name]}
  "$venv/bin/python" -c "import torch; assert not torch.version.cuda, torch.version.cuda" 2>/dev/null ||
    { echo "install_peers: a training dependency of $name replaced torch with a CUDA build; remove $venv" >&2; exit 1; }
  "$venv/bin/python" -W ignore -c "${TRAIN_CHECK[$name]}" ||
    { echo "install_peers: $name's training path does not import" >&2; exit 1; }
  echo "${TRAIN_DEPS[$name]}" >"$venv/.draftsmith-train-installed"
  echo "$name: training deps ${TRAIN_DEPS[$name]}"
}

mkdir -p "$ROOT"
train=0
peers=()
for arg in "$@"; do
  if [ "$arg" = --train ]; then train=1; else peers+=("$arg"); fi
done
[ ${#peers[@]} -gt 0 ] || peers=(modelopt specforge speculators)
for name in "${peers[@]}"; do
  [ -n "${RELEASE[$name]:-}" ] || { echo "install_peers: unknown peer '$name' (modelopt, specforge, speculators)" >&2; exit 2; }
  install_peer "$name"
  [ "$train" = 0 ] || install_training "$name"
done
