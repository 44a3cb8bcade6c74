#!/usr/bin/env bash
# The EAGLE-3 recipe's ablations on the default at 0.4M training positions, on one machine: the default itself (the
# reference every row is compared with, so a machine whose training precision differs from the 0.4M table's,
# bf16-mixed on the Xeon, compares like for like), then each of the peers' differences the default does not take,
# one at a time, each judged on the held-out rows as it ends (bench/heldout_tau.py, k 5). bench/eagle3_recipe.py
# then prints them beside the table's ablations (--ablations: each row against its own record's default).
#
# Every run is kept in the --out record once it has finished (bench/peer_training.py) and a run stopped part way
# resumes from its last checkpoint, so this can be stopped and run again. About 40 minutes a run on a 2-core CPU
# alone; give it the CPU alone (`echo 19 > /proc/self/autogroup` for a background job), or stop it (SIGSTOP /
# SIGCONT) while timing anything else.
#
#   bash bench/eagle3_ablations.sh                 # every run left, then the table
#   STEPS="train" bash bench/eagle3_ablations.sh   # only the runs
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python}
TOKENS=${TOKENS:-409600}
WORK=${WORK:-runs/sweep_400k}
OUT=${OUT:-bench/results/eagle3_ablations_400k.json}
STEPS=${STEPS:-"train table"}
DEFAULT="trainer.batch_size=1,optim.name=muon,draft.options.norm_before_fc=true,draft.options.norm_output=true"
DEFAULT="$DEFAULT,draft.options.norm_before_residual=true"
# the reference first; then the changes in the order of what they are likeliest to move (labels: bench/eagle3_recipe.py):
# speculators' linear decay to 0 first, since at 1.6M its heads caught up with the default's (cosine to 0.1) on the
# held-out rows
RUNS=(
    "draftsmith-r45norms:$DEFAULT"
    "draftsmith-r45dlin:$DEFAULT,optim.schedule=linear,optim.min_lr_ratio=0,optim.warmup_steps=8"
    "draftsmith-r45dopt:$DEFAULT,optim.lr=1e-4,optim.muon_lr=1e-3,optim.weight_decay=0.01,optim.grad_clip=1.0"
    "draftsmith-r45dnoise:$DEFAULT,draft.options.feature_noise=0.05"
    "draftsmith-r45ddpace:$DEFAULT,draft.options.step_weighting=dpace"
    "draftsmith-r45dlk:$DEFAULT,draft.options.loss=lk_hybrid"
    "draftsmith-r45fcres:${DEFAULT/draft.options.norm_output=true/draft.options.norm_output=false}"
)

has() { [[ " $STEPS " == *" $1 "* ]]; }

if has train; then
    [[ -f $WORK/data/budget.json ]] || $PY bench/peer_training.py --tokens "$TOKENS" --work "$WORK" --stages data --out "$OUT"
    for run in "${RUNS[@]}"; do
        $PY bench/peer_training.py --tokens "$TOKENS" --work "$WORK" --stages train judge --runs --setting "$run" --out "$OUT"
    done
fi

if has table; then
    $PY bench/eagle3_recipe.py --ablations "$OUT" --out bench/results/eagle3_recipe.json
fi
