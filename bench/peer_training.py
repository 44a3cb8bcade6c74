"""EAGLE-3 (or, --draft dflash, DFlash) training side by side: the peers and draftsmith on the same work.

Every run trains one decoder layer for the bundled SmolLM2-135M-Instruct with the same draft
vocabulary size and TTT depth (DFlash: block size 8, target layers 1, 14, 26), on the same tokens and
loss masks, for the same number of tokens; each peer keeps its own defaults otherwise (lr, optimizer,
schedule, batching). DFlash is trained by SpecForge, speculators and draftsmith (ModelOpt 0.47's
``plugins/hf_dflash.py`` trains online only and has no driver here yet). Stages (--stages):

  data     render draftsmith's builtin training data once with ``draftsmith.train.corpus`` (chat
           template, assistant loss mask, packed rows, the quickstart's held-out rows), take the rows
           draftsmith's sampler trains on first until --tokens, split them back into conversations and
           write those in each peer's input layout (the peers pad or pack conversations themselves;
           bench/benchlib/peer_inputs.py)
  capture  the stand-in for SGLang's / vLLM's hidden-state capture, which do not run here: the target
           run by transformers, in the dtype draftsmith's recipe runs it in (``target.dtype: auto``), over
           every conversation, written as SpecForge's ``.ckpt`` files and
           speculators' ``hs_{i}.safetensors`` (timed apart: it is not part of either peer's training)
  train    each peer in its own venv (bench/peers/*.py, which say where they depart from the peer's
           own pipeline), then ``draftsmith train quickstart``, one at a time under the machine-wide
           bench lock; wall and CPU seconds, peak RSS, per-step timestamps, held-out metrics, the head
  judge    each head's τ on the quickstart's held-out rows by ``bench/heldout_tau.py``, right after
           it trains: the one judge a sweep chooses each pipeline's setting by (never dev)
  eval     one ``draftsmith eval`` run per k (5, auto) over every head (peer heads are read by
           drafts/eagle_import.py), greedy, dev prompts in round-robin order

Prints a table, writes JSON (--out). What it costs on the 2-core CPU it was written on: at
--tokens 16384 about 3-6 min of training per peer; the peers' steps are the slow part, see
BENCHMARKS.md for the measured rates.

    python bench/peer_training.py --tokens 16384 --out bench/results/peer_training_16k.json
    python bench/peer_training.py --tokens 409600 --work runs/peer_training_400k \
        --out bench/results/peer_training_400k.json
    python bench/peer_training.py --draft dflash --runs specforge speculators --tokens 409600 \
        --work runs/peer_dflash_400k --out bench/results/peer_dflash_400k.json

A sweep (issue "Honest numbers": every pipeline tuned at the budget as draftsmith's recipe was) is a list of
``--setting PIPELINE-NAME:...`` runs in each pipeline's own words, chosen afterwards on the held-out split.
Each finished run is saved into --out at once and kept on the next invocation, so a sweep stopped half way
goes on where it stopped:

    python bench/peer_training.py --tokens 409600 --work runs/sweep --stages train --runs \
        --setting specforge-lr3e4:training.learning_rate=3e-4 \
        --setting specforge-lr1e3b4:training.learning_rate=1e-3,training.batch_size=4 \
        --setting speculators-adamw:optimizer=adamw,lr=3e-4,total-seq-len=2048 \
        --setting modelopt-wu50:training.warmup_steps=50 --out bench/results/peer_sweep_400k.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from peerbench.common import (
    QUICKSTART_DATA,
    RUNS,
    STAGES,
    TARGET,
    cpu_name,
    parse_ablation,
    parse_setting,
    quickstart_seed,
)
from peerbench.data import stage_capture, stage_data
from peerbench.evaluation import stage_eval, stage_llamacpp
from peerbench.report import print_table
from peerbench.training import judge_missing, stage_train, throughput


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokens", type=int, default=16384, help="training positions per run (rounded up to whole batches)"
    )
    p.add_argument(
        "--work", type=Path, default=Path("runs/peer_training"), help="data, features, heads, logs"
    )
    p.add_argument(
        "--runs",
        nargs="*",
        default=list(RUNS),
        choices=RUNS,
        help="peers and draftsmith (none: only the --ablation and --setting runs)",
    )
    p.add_argument("--ablation", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="also train draftsmith's recipe with these overrides, as run draftsmith-NAME (repeatable; "
                   "trainer.batch_size keeps the rows, not the steps)")  # fmt: skip
    p.add_argument("--setting", action="append", default=[], metavar="PIPELINE-NAME:KEY=VALUE[,KEY=VALUE]",
                   help="also train PIPELINE with its own settings changed, as run PIPELINE-NAME (repeatable; a "
                   "sweep): draftsmith and ModelOpt take recipe keys (optim.lr=1e-4; training.learning_rate=3e-4), "
                   "SpecForge its config keys (training.learning_rate=3e-4, training.warmup_ratio=0.05, "
                   "training.batch_size=2, training.seed=1), speculators its flags without dashes (lr=3e-4, "
                   "scheduler-warmup-steps=5, total-seq-len=4096, seed=1)")  # fmt: skip
    p.add_argument(
        "--rerun",
        action="store_true",
        help="train runs again that the --out record already holds as finished (default: keep them)",
    )
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--draft", choices=("eagle3", "dflash"), default="eagle3", help="draft kind (data stage)")
    p.add_argument("--eval-limit", type=int, default=12, help="dev prompts in each eval run")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=Path("bench/results/peer_training.json"))
    args = p.parse_args(argv)
    work = args.work.resolve()
    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    from benchlib.records import provenance

    record.update({"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "target": TARGET,
                   "data": list(QUICKSTART_DATA), "work": str(work), "provenance": provenance(seed=quickstart_seed())})  # fmt: skip

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        tmp.replace(args.out)

    if "data" in args.stages:
        record["budget"] = stage_data(work, args.tokens, args.draft)
    budget = json.loads((work / "data" / "budget.json").read_text())
    record["budget"] = budget
    if "capture" in args.stages:
        record["capture"] = stage_capture(work)
        save()
    if "train" in args.stages:
        ablations = dict(parse_ablation(a) for a in args.ablation) | dict(
            parse_setting(s) for s in args.setting
        )
        judge = "judge" in args.stages
        stage_train(
            work, args.runs, budget, record.setdefault("train", {}), save, ablations, args.rerun, judge
        )
    if "judge" in args.stages:
        judge_missing(work, record.get("train", {}), save)
    for run in record.get("train", {}).values():  # rates from the marks, also for runs kept from before
        if "wall_s" in run:
            run.update(throughput(run, budget))
    if "eval" in args.stages:
        record["eval"] = stage_eval(work, record.get("train", {}), args.eval_limit, args.max_new_tokens)
    if "llamacpp" in args.stages:
        record["llamacpp"] = stage_llamacpp(
            work, record.get("train", {}), args.eval_limit, args.max_new_tokens
        )
    save()
    from benchlib.llamacpp_runs import print_judged

    print_table(budget, record.get("capture"), record.get("train", {}))
    print_judged(record.get("eval") or {}, (record.get("llamacpp") or {}).get("rows") or {})
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
