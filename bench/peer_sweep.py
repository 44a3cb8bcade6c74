"""Each pipeline's chosen setting at three seeds, judged on dev in one run: the second half of the sweep.

bench/peer_training.py trains the sweep (its ``--setting PIPELINE-NAME:...`` runs, each pipeline's own settings
in its own words) and judges every head on the quickstart's held-out rows right after it trains. This script
takes that record (--record) and:

  choose   per pipeline, the setting whose head has the highest held-out τ (bench/heldout_tau.py, k 5, the one
           judge for every pipeline; never dev), or the run --choose names
  seeds    the chosen setting again at seeds 1 and 2 (in each pipeline's own words:
           peerbench.common.SEED_KEYS), beside the chosen run at the pipeline's default seed, trained into the
           same record (resumable: a finished run is kept)
  judge    one run of bench/vllm_engine.py over all the heads: draftsmith's decoder (one interleaved evaluate,
           float32, greedy, k 5, dev prompts round-robin) and vLLM serving each head (batch 1 and 16; draftsmith's
           export of it, or the folder the peer wrote where that layout cannot carry its EAGLE-3 variant;
           skipped, saying so, where vLLM is not installed), then llama.cpp
           (peerbench.evaluation.stage_llamacpp: Q4_1 and F32 targets, k 5)
  summary  per pipeline, mean ± standard deviation over the three seeds: held-out τ, dev τ and speedup in
           draftsmith's decoder, vLLM's acceptance length and speedup, llama.cpp's τ and speedup

Every pipeline's heads are judged in the same runs, so their speedups share the machine's state; the spread
over seeds is what a second training of the same recipe moves the figures by. Prints a table, writes JSON
(--out) with provenance; the training runs stay in --record.

    python bench/peer_sweep.py --record bench/results/peer_sweep_400k.json --work runs/sweep_400k \\
        --out bench/results/peer_seeds_400k.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from peerbench.common import BENCH, JUDGE_K, SEED_KEYS, cpu_name, pipeline_of, run_timed
from peerbench.evaluation import stage_llamacpp
from peerbench.training import finished, stage_train

SEEDS = (1, 2)
"""The replicate seeds beside each pipeline's default (draftsmith 0, SpecForge and speculators 42, ModelOpt 0)."""


def judged_tau(record: dict) -> float | None:
    return (record.get("judge") or {}).get("tau")


def choose(train: dict, named: list[str] = ()) -> dict[str, str]:
    """pipeline → its chosen run: the one --choose names, else the highest held-out τ among its sweep runs
    (seed replicates are not candidates)."""
    chosen = {pipeline_of(run): run for run in named}
    for run, record in train.items():
        pipeline = pipeline_of(run)
        if pipeline in {pipeline_of(r) for r in named} or "-seed" in run or judged_tau(record) is None:
            continue
        if pipeline not in chosen or judged_tau(record) > judged_tau(train[chosen[pipeline]]):
            chosen[pipeline] = run
    return chosen


def only(chosen: dict[str, str], pipelines: list[str]) -> dict[str, str]:
    """The chosen runs of ``pipelines`` in that order (all of them when none is named)."""
    unknown = [p for p in pipelines if p not in chosen]
    if unknown:
        raise SystemExit(
            f"--pipelines {' '.join(unknown)}: no judged run of it in the record (pipelines with one: "
            f"{', '.join(chosen)})"
        )
    return {p: chosen[p] for p in pipelines} if pipelines else chosen


def replicate(run: str, seed: int) -> str:
    return f"{run}-seed{seed}"


def seed_runs(train: dict, chosen: dict[str, str]) -> dict[str, list[str]]:
    """Replicate run name → its overrides: the chosen run's own plus the seed in the pipeline's words."""
    runs = {}
    for pipeline, run in chosen.items():
        overrides = list(train[run].get("overrides") or [])
        runs[run] = overrides  # trained again only if its record does not stand (or --retrain names it)
        for seed in SEEDS:
            runs[replicate(run, seed)] = [*overrides, f"{SEED_KEYS[pipeline]}={seed}"]
    return runs


def groups(chosen: dict[str, str]) -> dict[str, list[str]]:
    """pipeline → its three runs (default seed first)."""
    return {p: [run, *(replicate(run, s) for s in SEEDS)] for p, run in chosen.items()}


def judge(work: Path, heads: dict[str, str], out: Path, limit: int, max_new_tokens: int) -> dict:
    """One bench/vllm_engine.py run over every head (draftsmith's decoder, then vLLM), then llama.cpp."""
    cmd = [sys.executable, str(BENCH / "vllm_engine.py"), "--no-ngram", "--limit", str(limit),
           "--max-new-tokens", str(max_new_tokens), "--k", str(JUDGE_K), "--work", str(work / "vllm"),
           "--out", str(out), "--head", *(f"{run}={head}" for run, head in heads.items())]  # fmt: skip
    timed = run_timed(cmd, work / "vllm.log")
    engines = json.loads(out.read_text()) if out.exists() and not timed["returncode"] else None
    results = {run: {"head": head, "returncode": 0} for run, head in heads.items()}
    llama = stage_llamacpp(work, results, limit, max_new_tokens, JUDGE_K)
    return {"engines_command": timed, "engines": engines, "llamacpp": llama}


def mean_sd(values: list) -> dict | None:
    xs = [float(v) for v in values if isinstance(v, (int, float))]
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else None, "n": len(xs),
            "values": xs}  # fmt: skip


def summarise(train: dict, members: dict[str, list[str]], judged: dict) -> dict:
    """pipeline → mean ± sd over its seeds of every figure the judges gave."""
    engines = judged.get("engines") or {}
    ours, served = engines.get("draftsmith") or {}, engines.get("vllm") or {}
    llama = (judged.get("llamacpp") or {}).get("rows") or {}
    exports = (judged.get("llamacpp") or {}).get("exports") or {}
    out = {}
    for pipeline, runs in members.items():
        rows = {
            "heldout_tau": [judged_tau(train.get(r, {})) for r in runs],
            "dev_tau": [ours.get(f"eagle3:{r}", {}).get("tau") for r in runs],
            "dev_speedup": [ours.get(f"eagle3:{r}", {}).get("speedup") for r in runs],
            "vllm_tau": [served.get(f"eagle3:{r}", {}).get("batch_1", {}).get("tau") for r in runs],
            "vllm_speedup": [served.get(f"eagle3:{r}", {}).get("batch_1", {}).get("speedup") for r in runs],
            "llamacpp_tau_q4_1": [llama.get(f"q4_1:{r}", {}).get("tau") for r in runs],
            "llamacpp_speedup_q4_1": [llama.get(f"q4_1:{r}", {}).get("speedup") for r in runs],
            "llamacpp_tau_f32": [llama.get(f"f32:{r}", {}).get("tau") for r in runs],
        }
        exact = [ours.get(f"eagle3:{r}", {}).get("exact_match") for r in runs]
        refused = {r: e["tail"].strip().splitlines()[-1] for r in runs
                   if (e := exports.get(r)) and e.get("returncode") and e.get("tail", "").strip()}  # fmt: skip
        out[pipeline] = {"runs": runs, "setting": train[runs[0]].get("overrides") or [],
                         "exact_match": exact, "llamacpp_refused": refused,
                         **{k: mean_sd(v) for k, v in rows.items()}}  # fmt: skip
    return out


def print_summary(train: dict, chosen: dict[str, str], summary: dict) -> None:
    print(f"\n{'run':<28} {'held-out τ':>10}  chosen")
    for run, record in train.items():
        if "-seed" not in run and judged_tau(record) is not None:
            mark = "*" if chosen.get(pipeline_of(run)) == run else ""
            print(f"{run:<28} {judged_tau(record):>10.3f}  {mark}")

    def f(cell, spec=".3f"):
        if not cell:
            return "-"
        sd = "" if cell["sd"] is None else f" ± {cell['sd']:{spec}}"
        return f"{cell['mean']:{spec}}{sd}"

    keys = ("heldout_tau", "dev_tau", "dev_speedup", "vllm_tau", "vllm_speedup", "llamacpp_tau_q4_1",
            "llamacpp_speedup_q4_1")  # fmt: skip
    print(f"\n{'pipeline':<12} " + " ".join(f"{k:>22}" for k in keys))
    for pipeline, row in summary.items():
        print(f"{pipeline:<12} " + " ".join(f"{f(row[k]):>22}" for k in keys))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", type=Path, required=True, help="bench/peer_training.py's --out of the sweep")
    p.add_argument("--work", type=Path, required=True, help="the sweep's --work (data, captures, heads)")
    p.add_argument("--choose", nargs="*", default=[], metavar="RUN",
                   help="take these runs as their pipelines' choice instead of the best held-out τ")  # fmt: skip
    p.add_argument("--stages", nargs="+", default=["seeds", "judge"], choices=("seeds", "judge"))
    p.add_argument("--pipelines", nargs="+", default=[], metavar="PIPELINE",
                   help="train these pipelines' seeds only, in this order (a long sweep in parts; the judge "
                        "always takes every pipeline's)")  # fmt: skip
    p.add_argument("--retrain", nargs="+", default=[], metavar="RUN",
                   help="train these seeds-stage runs again though their records stand (judged, their heads gone "
                        "with another machine's work folder), so the judge has their heads; the earlier "
                        "records are kept under 'earlier'")  # fmt: skip
    p.add_argument("--partial", action="store_true",
                   help="judge the runs whose heads are here and say which are not (each figure's n says how "
                        "many seeds it averages), instead of refusing")  # fmt: skip
    p.add_argument("--limit", type=int, default=12, help="dev prompts")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=Path("bench/results/peer_seeds_400k.json"))
    args = p.parse_args(argv)
    work = args.work.resolve()
    if not args.record.is_file():
        raise SystemExit(
            f"--record {args.record}: no such file; the sweep's record is bench/peer_training.py's --out"
        )
    record = json.loads(args.record.read_text())
    train = record.setdefault("train", {})
    unknown = [run for run in args.choose if run not in train]
    if unknown:
        raise SystemExit(f"--choose {' '.join(unknown)}: not in {args.record} (runs: {', '.join(train)})")
    chosen = choose(train, args.choose)
    if not chosen:
        raise SystemExit(
            f"{args.record} holds no judged runs: run bench/peer_training.py --stages train judge first"
        )

    def save_record() -> None:
        tmp = args.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        tmp.replace(args.record)

    members = groups(chosen)
    strays = [run for run in args.retrain if not any(run in runs for runs in members.values())]
    if strays:
        raise SystemExit(f"--retrain {' '.join(strays)}: not a seeds-stage run (those: "
                         f"{', '.join(run for runs in members.values() for run in runs)})")  # fmt: skip
    if "seeds" in args.stages:
        budget = json.loads((work / "data" / "budget.json").read_text())
        runs = seed_runs(train, only(chosen, args.pipelines))
        runs |= {run: seed_runs(train, chosen)[run] for run in args.retrain}
        stage_train(work, [], budget, train, save_record, runs, rerun=set(args.retrain), judge=True)
    from benchlib.records import provenance

    out = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "record": str(args.record),
           "chosen": chosen, "members": members, "provenance": provenance(seed=None)}  # fmt: skip
    if args.out.exists():
        out = {**json.loads(args.out.read_text()), **out}
    if "judge" in args.stages:
        heads = {
            run: train[run]["head"] for runs in members.values() for run in runs if finished(train.get(run))
        }
        missing = [run for runs in members.values() for run in runs if run not in heads]
        if missing and not (args.partial and heads):
            raise SystemExit(
                f"no head for {', '.join(missing)}: run the seeds stage first (a run judged on another machine "
                "keeps its record but not its head: --retrain RUN trains it here), or judge the heads here with "
                "--partial"
            )
        judged_file = args.out.with_name(args.out.stem + "_engines.json")
        # its own provenance: the file's top-level one is whichever stage wrote it last
        out["judged"] = {**judge(work, heads, judged_file, args.limit, args.max_new_tokens),
                         "provenance": provenance(seed=None)}  # fmt: skip
        out["not_judged"] = {
            run: "no head here (its record stands from another work folder)" for run in missing
        }
    out["summary"] = summarise(train, members, out.get("judged") or {})
    args.out.write_text(json.dumps(out, indent=1, default=str))
    print_summary(train, chosen, out["summary"])
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
