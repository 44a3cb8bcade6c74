#!/usr/bin/env bash
# Issue 19's GPU truth (bench/gpu_truth.py) as two device calls; figures into BENCHMARKS.md (the scoreboard)
# and docs/studies/gpu_h200.md, "GPU truth".
# The wheels, data and target travel as for issue 3's check (bench/gpu_eagle3_device.sh):
#   here:   bash bench/gpu_eagle3_device.sh prepare         (fills .dev/, which git ignores)
#   call 1: bash bench/gpu_truth_device.sh setup            carry .dev/whl .dev/tok .dev/data .dev/ga
#   call 2: bash bench/gpu_truth_device.sh main 8           carry .dev/gb, timeout_s 580 (within 30 s of call 1)
#   here:   mkdir P; cp <files_at>/head-* P; tar -xf <files_at>/meta.tar -C P
#           python bench/gpu_eagle3.py unpack P runs/gpu_truth/draft
#           draftsmith eval --draft runs/gpu_truth/draft --k 5 --limit 0 ...   (dev τ on the CPU evaluator)
# main runs every stage in one process inside MINUTES (data, train, decode); results.json and log.txt
# come back with the packed head (head-*.safetensors, meta.tar): at most 8 files.
set -uo pipefail
source "$(dirname "$0")/gpu_eagle3_device.sh"

setup() {
    install || return 1
    python3 -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name())"
}

main() {
    local minutes=$1
    device_env
    assemble_gguf
    python3 bench/gpu_truth.py --out "$OUT" --work /tmp/gpu/truth --minutes "$minutes" 2>&1 \
        | grep -v Warning | tee "$OUT/log.txt"
    ls -la "$OUT"
}

"$@"
