"""Cost-model k against fixed k: tokens/s of the target alone, every fixed k and k="auto", same prompts.

For each draft (``ngram`` and ``layers:N`` on the real target by default; add an EAGLE or Medusa
checkpoint with ``--draft PATH``), greedy, batch 1, first turns of the dev prompts, through
``eval.evaluate``: one ``Method`` per fixed k and one for ``auto`` (a cost model that learns online
from a fresh start and keeps what it learnt across the timed prompts), a warm-up on the first prompt,
the methods interleaved prompt by prompt, every output checked token for token against the target
alone, τ from ``eval/stats``. Prints a table, writes JSON.

    python bench/cost_model_k.py --limit 12 --max-new-tokens 128
    python bench/cost_model_k.py --draft runs/smollm2_eagle3/draft --limit 12
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from benchlib.records import write_json

from draftsmith.decode.cpu_kernels import pack_for_decoding
from draftsmith.decode.target import load_target
from draftsmith.drafts import build_drafter
from draftsmith.drafts.base import LAYERS, NGRAM
from draftsmith.eval.harness import Method, MethodResult, evaluate
from draftsmith.eval.prompts import load_prompts
from draftsmith.eval.report import hardware_description


def row(result: MethodResult, base: float) -> dict:
    t, a = result.total.timing, result.total.acceptance
    return {"tokens": t.new_tokens, "seconds": t.seconds, "tokens_per_s": t.tokens_per_s, "tau": a.tau,
            "speedup": t.tokens_per_s / base, "exact": result.exact_match}  # fmt: skip


def run_draft(target, spec: str, prompts, ks: list[int], k_max: int, max_new: int, cpu_kernels: str) -> dict:
    """Every k (and auto) for one draft over the prompts; per-method totals."""
    drafter = build_drafter(spec, target)
    if cpu_kernels == "packed":
        pack_for_decoding(drafter)  # the target's layers are packed once in main()
    methods = [Method(f"k={k}", drafter, k) for k in ks] + [Method("auto", drafter, "auto")]
    result = evaluate(target, methods, prompts, max_new_tokens=max_new, k_max=k_max, warmup=1)
    base = result.baseline.total.timing.tokens_per_s
    rows = {"target alone": row(result.baseline, base), **{m.name: row(m, base) for m in result.drafts}}
    fixed = {name: r for name, r in rows.items() if name.startswith("k=")}
    best = max(fixed, key=lambda name: fixed[name]["tokens_per_s"])
    auto = result.drafts[-1]
    return {
        "methods": rows,
        "best_fixed": best,
        "auto_vs_best_fixed": rows["auto"]["tokens_per_s"] / fixed[best]["tokens_per_s"],
        "auto_vs_target_alone": rows["auto"]["speedup"],
        "auto_chosen_k": dict(sorted(auto.chosen_k.items())),
        "cost_model": auto.policy.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", default="builtin:dev_prompts")
    parser.add_argument("--limit", type=int, default=12, help="prompts (the first is also the warm-up)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--layers", type=int, default=8, help="depth of the layer-subset draft (0: leave it out)"
    )
    parser.add_argument("--draft", action="append", default=[], help="another draft spec or checkpoint path")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--k-max", type=int, default=8, help="largest k the cost model may pick")
    parser.add_argument("--cpu-kernels", choices=["packed", "stock"], default="packed",
                        help="packed (default): linear layers run on prepacked oneDNN weights (decode/cpu_kernels.py)")  # fmt: skip
    parser.add_argument("--out", default="bench/results/cost_model_k.json")
    args = parser.parse_args()

    target = load_target(args.target, device=args.device, dtype="float32")
    if args.cpu_kernels == "packed":
        pack_for_decoding(target.model)
    first_turns = [dataclasses.replace(q, turns=q.turns[:1]) for q in load_prompts(args.prompts, args.limit, order="round-robin")]  # fmt: skip
    specs = [NGRAM, *([f"{LAYERS}:{args.layers}"] if args.layers > 0 else []), *args.draft]
    drafts = {}
    for spec in specs:
        d = drafts[spec] = run_draft(
            target, spec, first_turns, args.ks, args.k_max, args.max_new_tokens, args.cpu_kernels
        )
        print(
            f"\n{spec}\n  {'method':14s} {'tok/s':>8s} {'speedup':>8s} {'tau':>6s} {'exact':>6s}", flush=True
        )
        for name, r in d["methods"].items():
            print(
                f"  {name:14s} {r['tokens_per_s']:8.2f} {r['speedup']:7.2f}x {r['tau']:6.2f} {r['exact']!s:>6s}"
            )
        print(f"  auto / best fixed ({d['best_fixed']}) = {d['auto_vs_best_fixed']:.3f}; auto / target alone = "
              f"{d['auto_vs_target_alone']:.3f}; auto picked k: {d['auto_chosen_k']}", flush=True)  # fmt: skip
    write_json(args.out, {
        "target": target.name,
        "settings": vars(args) | {"num_prompts": len(first_turns), "greedy": True, "dtype": "float32"},
        "hardware": hardware_description(target.device, target.dtype), "date": time.strftime("%Y-%m-%d"),
        "drafts": drafts,
    })  # fmt: skip


if __name__ == "__main__":
    main()
