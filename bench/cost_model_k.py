"""Cost-model k against fixed k: tokens/s of the target alone, every fixed k and k="auto", same prompts.

For each draft (``ngram`` and ``layers:N`` on the real target by default; add an EAGLE or Medusa
checkpoint with ``--draft PATH``), greedy, batch 1, first turns of the dev prompts. The first prompt
is an untimed warm-up for every method; then the methods run interleaved prompt by prompt, so slow
drift of the machine spreads evenly. ``auto`` keeps one CostModel per draft across all timed prompts
(it learns online from a fresh start). Every output is checked token for token against the target
alone. Prints a table, writes JSON.

    python bench/cost_model_k.py --limit 12 --max-new-tokens 128
    python bench/cost_model_k.py --draft runs/smollm2_eagle3/draft --limit 12
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from draftsmith.decode.cost_model import CostModel
from draftsmith.decode.cpu_kernels import pack_for_decoding
from draftsmith.decode.speculative import generate
from draftsmith.decode.target import load_target
from draftsmith.drafts import build_drafter
from draftsmith.eval.prompts import load_prompts, render
from draftsmith.eval.report import hardware_description

BASELINE = "target alone"


def run_draft(
    target,
    spec: str,
    prompts: list[torch.Tensor],
    ks: list[int],
    k_max: int,
    max_new: int,
    cpu_kernels: str = "packed",
) -> dict:
    """Every method for one draft over the prompts (prompts[0] = warm-up); per-method totals."""
    drafter = build_drafter(spec, target)
    if cpu_kernels == "packed":
        pack_for_decoding(drafter)  # the target's layers are packed once in main()
    policy = CostModel(k_max=k_max)
    methods = [(BASELINE, None, 0)] + [(f"k={k}", drafter, k) for k in ks] + [("auto", drafter, policy)]
    for _, method_drafter, k in methods:  # warm-up; auto's on a throwaway model, so timing starts cold-free
        warm_k = CostModel(k_max=k_max) if isinstance(k, CostModel) else k
        generate(target, prompts[0], method_drafter, warm_k, min(max_new, 32))
    totals = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "exact": 0} for name, _, _ in methods}
    chosen: Counter[int] = Counter()
    for prompt in prompts[1:]:
        reference = None
        for name, method_drafter, k in methods:
            result = generate(target, prompt, method_drafter, k, max_new)
            reference = result.tokens if reference is None else reference
            row = totals[name]
            row["tokens"] += len(result.tokens)
            row["seconds"] += result.seconds
            row["forwards"] += result.target_forwards - 1
            row["exact"] += result.tokens == reference
            if name == "auto":
                chosen.update(result.chosen_k)
    for row in totals.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"] if row["seconds"] else 0.0
        row["tau"] = (row["tokens"] - len(prompts[1:])) / row["forwards"] if row["forwards"] else 1.0
    base = totals[BASELINE]["tokens_per_s"]
    for row in totals.values():
        row["speedup"] = row["tokens_per_s"] / base if base else 0.0
    fixed = {name: row for name, row in totals.items() if name.startswith("k=")}
    best = max(fixed, key=lambda name: fixed[name]["tokens_per_s"])
    auto = totals["auto"]["tokens_per_s"]
    return {
        "methods": totals,
        "best_fixed": best,
        "auto_vs_best_fixed": auto / fixed[best]["tokens_per_s"] if fixed[best]["tokens_per_s"] else 0.0,
        "auto_vs_target_alone": auto / base if base else 0.0,
        "auto_chosen_k": dict(sorted(chosen.items())),
        "cost_model": policy.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", default="../shared/data/dev/prompts.jsonl")
    parser.add_argument("--limit", type=int, default=12, help="timed prompts (one more is the warm-up)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--layers", type=int, default=8, help="depth of the layer-subset draft (0: leave it out)"
    )
    parser.add_argument("--draft", action="append", default=[], help="another draft spec or checkpoint path")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--k-max", type=int, default=8, help="largest k the cost model may pick")
    parser.add_argument(
        "--cpu-kernels",
        choices=["packed", "stock"],
        default="packed",
        help="packed (default): linear layers run on prepacked oneDNN weights (decode/cpu_kernels.py)",
    )
    parser.add_argument("--out", default="bench/results/cost_model_k.json")
    args = parser.parse_args()

    target = load_target(args.target, device=args.device, dtype="float32")
    if args.cpu_kernels == "packed":
        pack_for_decoding(target.model)
    prompts = [
        render(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
        for p in load_prompts(args.prompts, args.limit + 1, order="round-robin")
    ]
    if len(prompts) < 2:
        raise SystemExit(f"{args.prompts} has fewer than 2 prompts (one warm-up and one timed)")
    specs = ["ngram", *([f"layers:{args.layers}"] if args.layers > 0 else []), *args.draft]
    drafts = {}
    for spec in specs:
        drafts[spec] = run_draft(
            target, spec, prompts, args.ks, args.k_max, args.max_new_tokens, args.cpu_kernels
        )
        print(f"\n{spec}", flush=True)
        print(f"  {'method':14s} {'tok/s':>8s} {'speedup':>8s} {'tau':>6s} {'exact':>6s}")
        for name, row in drafts[spec]["methods"].items():
            print(
                f"  {name:14s} {row['tokens_per_s']:8.2f} {row['speedup']:7.2f}x {row['tau']:6.2f} "
                f"{row['exact']:3d}/{len(prompts) - 1}"
            )
        d = drafts[spec]
        print(
            f"  auto / best fixed ({d['best_fixed']}) = {d['auto_vs_best_fixed']:.3f}; "
            f"auto / target alone = {d['auto_vs_target_alone']:.3f}; auto picked k: {d['auto_chosen_k']}",
            flush=True,
        )
    result = {
        "target": target.name,
        "settings": vars(args) | {"num_prompts": len(prompts) - 1, "greedy": True, "dtype": "float32"},
        "hardware": hardware_description(target.device, target.dtype),
        "date": time.strftime("%Y-%m-%d"),
        "drafts": drafts,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
