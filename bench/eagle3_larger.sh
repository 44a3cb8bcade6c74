#!/usr/bin/env bash
# The EAGLE-3 deciding table at a larger budget (default 1.6M training positions, 4x the 0.4M table): draftsmith's
# default against speculators' chosen point (1,024-token steps), 2 seeds each, each judged on the held-out rows as it
# ends, then one interleaved `draftsmith eval` of the four heads on 96 dev prompts, then bench/eagle3_recipe.py with
# the larger budget's rows beside the 0.4M table.
#
# Every step can be stopped and run again: the data stage and the capture are skipped once done (a capture stopped
# part way goes on from the conversations it wrote: bench/benchlib/peer_inputs.py), a finished run
# is kept in the --out record (bench/peer_training.py), draftsmith's run stopped part way resumes from its last
# checkpoint, and a run the record judged whose head is gone (runs/ lost with a machine) trains again before the
# dev run, which reads every head no dev report judged yet (a dev run split by a machine's end goes on in a
# report of its own: greedy τ does not depend on what else ran). On a 2-core CPU this is about 8 hours (docs/studies/eagle3_training.md,
# "1.6M tokens"); give it the CPU alone (`echo 19 > /proc/self/autogroup` for a background job), or stop it
# (SIGSTOP / SIGCONT) while timing anything else.
#
#   bash bench/eagle3_larger.sh                 # everything left
#   STEPS="train" bash bench/eagle3_larger.sh   # only what trains (data, runs, capture), no dev run or table
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python}
DRAFTSMITH=${DRAFTSMITH:-draftsmith}
TOKENS=${TOKENS:-1638400}
WORK=${WORK:-runs/sweep_1600k}
OUT=${OUT:-bench/results/eagle3_recipe_1600k.json}
DEV=${DEV:-$WORK/dev96}
# the dev reports: one interleaved run over the heads, or several where a machine's end split it (its heads went with
# its runs/); a head some report already judged is not judged again, nor trained again for it
DEV_PREFIX=${DEV_PREFIX:-bench/results/eagle3_dev_1600k}
shopt -s nullglob
DEV_REPORTS=("$DEV_PREFIX".json "$DEV_PREFIX"_*.json)
shopt -u nullglob
n=${#DEV_REPORTS[@]}
DEV_RESULT=${DEV_RESULT:-$([[ $n -eq 0 ]] && echo "$DEV_PREFIX.json" || echo "${DEV_PREFIX}_$((n + 1)).json")}
STEPS=${STEPS:-"train dev table"}
DEFAULT="trainer.batch_size=1,optim.name=muon,draft.options.norm_before_fc=true,draft.options.norm_output=true"
DEFAULT="$DEFAULT,draft.options.norm_before_residual=true"
# draftsmith's runs first: they train online (the target in every step) and need only the data stage, so they
# start while the peers' capture has not run yet
RUNS=(
    "draftsmith-r45norms:$DEFAULT"
    "draftsmith-r45norms-seed1:$DEFAULT,trainer.seed=1"
    "speculators-seq1024:total-seq-len=1024"
    "speculators-seq1024-seed1:total-seq-len=1024,seed=1"
)

has() { [[ " $STEPS " == *" $1 "* ]]; }
# whether the --out record holds a finished stage (the capture is recorded only once it has written everything)
recorded() { [[ -f $OUT ]] && $PY -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1])).get(sys.argv[2]))' "$OUT" "$1"; }
# whether the record judged a run whose head is gone (runs/ lost with a machine): the dev run needs every head, so
# such a run trains again (its earlier record kept under "earlier")
# (or is a part-trained one of that training going on again in its folder: bench/peerbench/training.py's head_there)
head_gone() { [[ -f $OUT ]] && PYTHONPATH=bench $PY -c 'import json, sys
from peerbench.training import head_there
run = json.load(open(sys.argv[1])).get("train", {}).get(sys.argv[2]) or {}
sys.exit(not (run.get("head") and not head_there(run)))' "$OUT" "$1"; }

# whether a dev report holds a head of the run (a part of the head's path names it, as bench/eagle3_recipe.py reads it)
dev_judged() { $PY -c 'import json, sys
from pathlib import Path
name = sys.argv[1]
sys.exit(not any(name in Path(d["name"]).parts for r in sys.argv[2:] for d in json.load(open(r))["drafts"]))' \
    "$1" ${DEV_REPORTS[@]+"${DEV_REPORTS[@]}"}; }

if has train; then
    [[ -f $WORK/data/budget.json ]] || $PY bench/peer_training.py --tokens "$TOKENS" --work "$WORK" --stages data --out "$OUT"
    for run in "${RUNS[@]}"; do
        if [[ $run != draftsmith-* ]] && ! recorded capture; then  # the peers train from the capture
            $PY bench/peer_training.py --tokens "$TOKENS" --work "$WORK" --stages capture --out "$OUT"
        fi
        again=()
        if has dev && head_gone "${run%%:*}" && ! dev_judged "${run%%:*}"; then again=(--rerun); fi
        $PY bench/peer_training.py --tokens "$TOKENS" --work "$WORK" --stages train judge --runs --setting "$run" \
            --out "$OUT" "${again[@]}"
    done
fi

if has dev; then
    # the heads the record holds that no dev report judged yet, in its order; one eval, prompt by prompt round the
    # heads and the target alone
    mapfile -t HEADS < <($PY -c 'import json, sys
for name, run in json.load(open(sys.argv[1]))["train"].items():
    if run.get("head"):
        print(name); print(run["head"])' "$OUT")
    DRAFTS=()
    for ((i = 0; i < ${#HEADS[@]}; i += 2)); do
        dev_judged "${HEADS[i]}" || DRAFTS+=(--draft "${HEADS[i + 1]}")
    done
    if [[ ${#DRAFTS[@]} -gt 0 ]]; then
        EVAL=(eval --target smollm2-135m-instruct --prompts builtin:dev_prompts --limit 96 --order round-robin
            --max-new-tokens 64 --k 5 --cpu-kernels stock "${DRAFTS[@]}" --out "$DEV" --overwrite)
        "$DRAFTSMITH" "${EVAL[@]}"
        # the report as the result, with the provenance draftsmith eval does not write (this checkout's commit)
        PYTHONPATH=bench $PY -c 'import json, sys
from benchlib.records import provenance, write_json
write_json(sys.argv[2], json.load(open(sys.argv[1])) | {"provenance": provenance() | {"command": sys.argv[3]}})' \
            "$DEV/report.json" "$DEV_RESULT" "draftsmith ${EVAL[*]}"
        DEV_REPORTS+=("$DEV_RESULT")
    fi
fi

if has table; then
    # the 0.4M inputs are the script's defaults (the committed records); the larger budget's rows join them
    $PY bench/eagle3_recipe.py --larger "$OUT" --larger-dev ${DEV_REPORTS[@]+"${DEV_REPORTS[@]}"} \
        --out bench/results/eagle3_recipe.json
fi
