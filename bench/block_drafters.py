"""Block drafters against the EAGLE-3 head at the quickstart's data and budget: the figure that decides.

Every draft is trained by ``draftsmith train`` on the quickstart recipe (``configs/quickstart.yaml``: its data,
packing, optimiser, schedule, batch and steps, so the same 409,600 training positions) with only its
``draft`` section replaced and ``trainer.max_time`` lifted (equal tokens, not equal minutes):

  eagle3            the quickstart's own head (1 layer, 8,192-token draft vocabulary, 3 TTT steps)
  dflash-L{1,2}-b{8,16}  DFlash, 1 or 2 layers, blocks of 8 or 16, the same 8,192-token draft vocabulary
  peagle            P-EAGLE, 1 layer, 8 tokens per forward, the same draft vocabulary
  dflash-L1-b8-{a512,dpace}, dflash-L3-b8   the DFlash recipe's one-change ablations (every anchor, D-PACE, 3 layers)
  dflash-L1-b8-a512-{dpace,fullhead}   one change each on dflash-L1-b8-a512 (D-PACE, now DFlash's default; the
                    target's frozen full LM head)
  dspark-L1-b8[-a512[-dpace]]  DSpark: dflash-L1-b8 (or -a512, with D-PACE) with a rank-32 Markov head (trained and
                    judged by draftsmith only: vLLM's CPU build cannot serve DSpark; llama.cpp can,
                    tests/test_llamacpp_dspark.py)

then judged in one run of ``bench/vllm_engine.py``: draftsmith's decoder (one interleaved ``evaluate``, each
draft at its own k: EAGLE-3 5, DFlash block size - 1, P-EAGLE its parallel depth; τ, acceptance by position,
drafting ms per step, speedup, its bound and the τ that would break even) and vLLM 0.32 serving every export
(its own acceptance counters), beside n-gram and the target alone. ``--peer NAME=DIR`` adds DFlash drafts
another pipeline trained (``bench/peer_training.py --draft dflash --tokens 409600``) to the same judging.

Resumable: a draft whose run holds ``draft/config.json`` is not trained again, a run stopped midway goes on
with ``--resume``. Prints the training table, writes JSON (--out; vLLM's judging in --judge-out).

    python bench/block_drafters.py --work runs/blocks --out bench/results/block_drafters.json \\
        --judge-out bench/results/block_drafters_judged.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
VOCAB = 8192
# Every block drafter names its anchors and slot weighting, so a setting keeps meaning what it was trained with
# when a default moves (anchors 64 -> 512, then decay -> D-PACE); tests/test_block_judge.py checks it.
DFLASH_DEFAULT = {"num_layers": 1, "block_size": 8, "draft_vocab_size": VOCAB, "anchors_per_row": 512,
                  "slot_weighting": "dpace"}  # fmt: skip
"""DFlash's default on the quickstart recipe (every anchor, D-PACE): the base of its one-change ablations."""
DRAFTS = {
    "eagle3": None,  # the quickstart's own draft section
    "dflash-L1-b8": {
        "kind": "dflash",
        "options": {
            "slot_weighting": "decay",
            "num_layers": 1,
            "block_size": 8,
            "draft_vocab_size": VOCAB,
            "anchors_per_row": 64,
        },
    },
    "dflash-L2-b8": {
        "kind": "dflash",
        "options": {
            "slot_weighting": "decay",
            "num_layers": 2,
            "block_size": 8,
            "draft_vocab_size": VOCAB,
            "anchors_per_row": 64,
        },
    },
    "dflash-L1-b16": {
        "kind": "dflash",
        "options": {
            "slot_weighting": "decay",
            "num_layers": 1,
            "block_size": 16,
            "draft_vocab_size": VOCAB,
            "anchors_per_row": 64,
        },
    },
    "dflash-L2-b16": {
        "kind": "dflash",
        "options": {
            "slot_weighting": "decay",
            "num_layers": 2,
            "block_size": 16,
            "draft_vocab_size": VOCAB,
            "anchors_per_row": 64,
        },
    },
    "peagle": {"kind": "peagle", "options": {"parallel_depths": 8, "draft_vocab_size": VOCAB}},
    # the DFlash recipe's ablations (issue "Block drafters that hold their own"), one change each on dflash-L1-b8
    "dflash-L1-b8-a512": {  # every valid anchor of a 512-token row, as the peers draw up to 512 a sequence
        "kind": "dflash",
        "options": {
            "slot_weighting": "decay",
            "num_layers": 1,
            "block_size": 8,
            "draft_vocab_size": VOCAB,
            "anchors_per_row": 512,
        },
    },
    "dflash-L1-b8-dpace": {  # D-PACE slot weights instead of the fixed decay (speculators' and ModelOpt's default)
        "kind": "dflash",
        "options": {
            "num_layers": 1,
            "block_size": 8,
            "draft_vocab_size": VOCAB,
            "slot_weighting": "dpace",
            "anchors_per_row": 64,
        },
    },
    "dflash-L3-b8": {  # 3 layers (the peers use 5)
        "kind": "dflash",
        "options": {
            "slot_weighting": "decay",
            "num_layers": 3,
            "block_size": 8,
            "draft_vocab_size": VOCAB,
            "anchors_per_row": 64,
        },
    },
    "dspark-L1-b8": {  # dflash-L1-b8 plus DSpark's Markov head (rank 32); vLLM's CPU build cannot serve it
        "kind": "dspark",
        "options": {
            "num_layers": 1,
            "block_size": 8,
            "draft_vocab_size": VOCAB,
            "markov_rank": 32,
            "anchors_per_row": 64,
            "slot_weighting": "decay",
        },
    },
    # one change each on the new default (dflash-L1-b8-a512), where speculators' tuned DFlash (D-PACE, the target's
    # frozen full LM head) drew level with it
    "dflash-L1-b8-a512-dpace": {"kind": "dflash", "options": dict(DFLASH_DEFAULT)},  # D-PACE slot weights
    # one change each on DFlash's default (every anchor, D-PACE), as the block drafter issue lists them
    "dflash-L3-b8-a512-dpace": {
        "kind": "dflash",
        "options": {**DFLASH_DEFAULT, "num_layers": 3},
    },  # the peers: 5
    "dflash-L1-b8-a512-dpace-fullhead": {  # the target's LM head, frozen, over its whole vocabulary
        "kind": "dflash",
        "options": {key: value for key, value in DFLASH_DEFAULT.items() if key != "draft_vocab_size"},
    },
    "dflash-L1-b8-a512-dpace-noise": {  # uniform feature noise +-0.05 in training steps (speculators')
        "kind": "dflash",
        "options": {**DFLASH_DEFAULT, "feature_noise": 0.05},
    },
    "dflash-L1-b8-a512-dpace-lk": {  # LK^lambda per slot: KL's gradient from a cold start (speculators' lk_hybrid)
        "kind": "dflash",
        "options": {**DFLASH_DEFAULT, "loss": "lk_hybrid"},
    },
    "dflash-L1-b8-a512-fullhead": {  # the target's LM head, frozen, over its whole vocabulary (the peers' head)
        "kind": "dflash",
        "options": {"slot_weighting": "decay", "num_layers": 1, "block_size": 8, "anchors_per_row": 512},
    },
    "dspark-L1-b8-a512": {  # the two one-change keepers together: DSpark's Markov head on every anchor
        "kind": "dspark",
        "options": {
            "num_layers": 1,
            "block_size": 8,
            "draft_vocab_size": VOCAB,
            "markov_rank": 32,
            "anchors_per_row": 512,
            "slot_weighting": "decay",
        },  # fmt: skip
    },
    "dspark-L1-b8-a512-dpace": {  # one change on dspark-L1-b8-a512: D-PACE slot weights, as DFlash's default now
        "kind": "dspark",
        "options": {
            "num_layers": 1,
            "block_size": 8,
            "draft_vocab_size": VOCAB,
            "markov_rank": 32,
            "anchors_per_row": 512,
            "slot_weighting": "dpace",
        },  # fmt: skip
    },
}


def run_name(name: str, seed: int) -> str:
    """The run folder of ``name`` trained with ``seed`` (seed 0 keeps the bare name the first runs used)."""
    return name if seed == 0 else f"{name}-seed{seed}"


def recipe(name: str, run: Path, seed: int = 0) -> dict:
    """The quickstart recipe with the draft section of ``name``, ``trainer.seed`` (initialisation and data
    order; the held-out split is ``data.seed``'s and stays the same) and no time limit."""
    data = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    if DRAFTS[name] is not None:
        data["draft"] = DRAFTS[name]
    data["trainer"]["max_time"] = None
    data["trainer"]["seed"] = seed
    data["output"]["dir"] = str(run)
    return data


def train(name: str, work: Path, seed: int = 0) -> dict:
    """Train ``name`` with ``seed`` under ``work/<run name>`` unless its draft is there; its record (command,
    wall seconds, seed, the run's last validation and step count as ``train_state.json`` says)."""
    run = work / run_name(name, seed)
    state = run / "draft" / "train_state.json"
    record: dict = {"run": str(run), "draft": name, "seed": seed}
    steps = recipe(name, run, seed)["trainer"]["max_steps"]
    if not state.is_file() or json.loads(state.read_text()).get("step", 0) < steps:  # validated at the end
        run.mkdir(parents=True, exist_ok=True)
        config = run.parent / f"{run.name}.yaml"
        config.write_text(yaml.safe_dump(recipe(name, run, seed), sort_keys=False))
        cmd = [sys.executable, "-m", "draftsmith.cli", "train", str(config)]
        if (run / "checkpoints").is_dir():
            cmd.append("--resume")
        print(f"[block_drafters] {' '.join(cmd)}", flush=True)
        started = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=REPO)
        record |= {"command": cmd, "wall_s": time.perf_counter() - started}
    saved = json.loads(state.read_text()) if state.is_file() else {}
    return record | {"train_state": saved}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/blocks", help="one run folder per draft")
    p.add_argument("--only", nargs="+", choices=list(DRAFTS), help="train and judge only these drafts")
    p.add_argument(
        "--peer", nargs="+", default=[], metavar="NAME=DIR", help="peers' DFlash drafts to judge too"
    )
    p.add_argument(
        "--seeds", nargs="+", type=int, default=[0],
        help="trainer.seed of each run (seed s > 0 trains into <draft>-seed<s>; the held-out rows stay the same)",
    )  # fmt: skip
    p.add_argument("--no-judge", action="store_true", help="train only")
    p.add_argument("--limit", type=int, default=12, help="dev prompts judged (round-robin over categories)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default="bench/results/block_drafters.json")
    p.add_argument("--judge-out", default="bench/results/block_drafters_judged.json")
    args = p.parse_args()
    work = Path(args.work).resolve()
    names = args.only or list(DRAFTS)
    trained = {run_name(n, seed): train(n, work, seed) for n in names for seed in args.seeds}
    print(f"\n{'run':<24} {'steps':>5} {'train s':>8} {'held-out τ':>10}")
    for name, r in trained.items():
        s = r["train_state"]
        print(
            f"{name:<24} {s.get('step', '-')!s:>5} {r.get('wall_s', float('nan')):>8.0f} {s.get('tau', float('nan')):>10.3f}"
        )
    from benchlib.records import provenance, write_json

    write_json(
        args.out,
        {
            "settings": vars(args),
            "drafts": DRAFTS,
            "trained": trained,
            "provenance": provenance(
                seed=args.seeds[0] if len(args.seeds) == 1 else None
            ),  # per run: trained[*].seed
        },
    )
    if args.no_judge:
        return
    runs = {run: r["draft"] for run, r in trained.items()}  # run folder name -> draft name
    heads = [f"{run}={work / run}" for run, n in runs.items() if n == "eagle3"]
    dflash = [f"{run}={work / run}" for run, n in runs.items() if n.startswith("dflash")] + list(args.peer)
    peagle = [f"{run}={work / run}" for run, n in runs.items() if n == "peagle"]
    cmd = [sys.executable, str(BENCH / "vllm_engine.py"), "--limit", str(args.limit), "--max-new-tokens",
           str(args.max_new_tokens), "--k", "5", "--work", str(work / "vllm"), "--out", args.judge_out]  # fmt: skip
    for flag, dirs in (("--head", heads), ("--dflash", dflash), ("--peagle", peagle)):
        cmd += [flag, *dirs] if dirs else []
    print(f"[block_drafters] {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


if __name__ == "__main__":
    main()
