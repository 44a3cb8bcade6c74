#!/usr/bin/env bash
# The peers' own DFlash at 0.4M training positions (the block-drafter issue's first item): SpecForge's and
# speculators' DFlash, each at its defaults and two points of its own settings (the record already holds the
# defaults and one point each: SpecForge at lr 5e-4, speculators at 1,024-token steps), each judged on the held-out
# rows as it ends; then each pipeline's best point by held-out τ (never dev) at seeds 1 and 2
# (bench/peer_sweep.py --stages seeds). bench/block_recipe.py sets them beside draftsmith's DFlash (--peers).
#
# Every step can be stopped and run again: the data stage is skipped once done and the capture once its files are
# all there (the record's capture may be another machine's, whose files went with it; one stopped part way goes on
# from the conversations it wrote), a finished run is kept in
# the --out record (bench/peer_training.py). On a 2-core CPU: the capture ~15 min, a SpecForge run ~35 min, a
# speculators run at 1,024-token steps ~50 min (bench/results/peer_dflash_400k.json). Give it the CPU alone
# (`echo 19 > /proc/self/autogroup` for a background job), or stop it (SIGSTOP / SIGCONT) while timing anything.
#
#   bash bench/dflash_peers.sh                          # everything left
#   PIPELINES=speculators bash bench/dflash_peers.sh    # one peer's points and seeds only
#   STEPS=points bash bench/dflash_peers.sh             # the settings only, no seeds
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python}
TOKENS=${TOKENS:-409600}
WORK=${WORK:-runs/peer_dflash/work}
OUT=${OUT:-bench/results/peer_dflash_400k.json}
STEPS=${STEPS:-"points seeds"}
PIPELINES=${PIPELINES:-"speculators specforge"}
# each peer's second point, in its own words, on the side its first point moved it: SpecForge's default lr is
# 1e-4 and 5e-4 gained (1.24 -> 1.31); speculators' default 8,192-token steps are 51 steps at this budget and
# 1,024-token steps gained (1.12 -> 1.63), so 512-token steps (about 900)
declare -A POINTS=(
    [specforge]="specforge-lr1e3:training.learning_rate=1e-3"
    [speculators]="speculators-t512:total-seq-len=512"
)

has() { [[ " $STEPS " == *" $1 "* ]]; }
# pipelines is a list of names (`read -a`: the only word splitting here)
read -r -a pipelines <<< "$PIPELINES"

[[ -f $WORK/data/budget.json ]] || $PY bench/peer_training.py --draft dflash --tokens "$TOKENS" --work "$WORK" \
    --stages data --out "$OUT"
# the capture writes speculators' split.json last: the files are all there once it is
[[ -f $WORK/speculators/split.json ]] || $PY bench/peer_training.py --draft dflash --tokens "$TOKENS" \
    --work "$WORK" --stages capture --out "$OUT"

if has points; then
    for pipeline in "${pipelines[@]}"; do
        $PY bench/peer_training.py --draft dflash --tokens "$TOKENS" --work "$WORK" --stages train judge --runs \
            --setting "${POINTS[$pipeline]}" --out "$OUT"
    done
fi

if has seeds; then
    $PY bench/peer_sweep.py --record "$OUT" --work "$WORK" --stages seeds --pipelines "${pipelines[@]}" \
        --out "${OUT%.json}_seeds.json"
fi
