"""`draftsmith data regenerate` throughput: transformers' continuous batching against static batches.

Both modes answer the same single-turn prompts (the first user turns of the shipped training files,
as `draftsmith data prompts` picks them), greedy, with the same conversations in flight, in one
process: static batches (left-padded ``generate``, a batch runs until its longest reply ends) and
continuous batching (a finished reply's row goes to the next prompt at once). Reports generated
tokens/s and the ratio; replies are compared too (batching changes the arithmetic, so in low precision
a few replies may differ after a near-tie). Prints a table, writes JSON.

    python bench/regenerate_throughput.py --count 256 --max-new-tokens 256 --batch-size 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from draftsmith.eval.report import hardware_description, write_json
from draftsmith.loading import load_causal_lm
from draftsmith.sources import BUILTIN_TRAIN
from draftsmith.train.corpus.prompts import first_user_turns
from draftsmith.train.corpus.regenerate import BATCHING, regenerate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument(
        "--data",
        nargs="+",
        default=[
            *BUILTIN_TRAIN,
        ],
    )
    p.add_argument("--count", type=int, default=256, help="prompts answered by each mode")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="conversations in flight, both modes")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--modes", nargs="+", choices=BATCHING[1:], default=["static", "continuous"])
    p.add_argument("--out", default="bench/results/regenerate_throughput.json")
    args = p.parse_args()

    model, tokenizer, name = load_causal_lm(args.target, args.device, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in first_user_turns(args.data, args.count)))
    # warm-up: kernels, allocator and the continuous-batching manager's first start, untimed
    for mode in args.modes:
        regenerate(
            model,
            tokenizer,
            [prompts],
            work / f"warm-{mode}.jsonl",
            max_new_tokens=8,
            batch_size=args.batch_size,
            limit=args.batch_size,
            progress=False,
            batching=mode,
        )

    rows, replies = [], {}
    print(f"{'batching':<12}{'prompts':>8}{'tokens':>9}{'cut':>6}{'seconds':>9}{'tok/s':>9}", flush=True)
    for mode in args.modes:
        out = work / f"{mode}.jsonl"
        start = time.perf_counter()
        stats = regenerate(
            model,
            tokenizer,
            [prompts],
            out,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            progress=False,
            batching=mode,
        )
        seconds = time.perf_counter() - start
        replies[mode] = {
            r["source_id"]: r["messages"][-1]["content"]
            for r in map(json.loads, out.read_text().splitlines())
        }
        row = {
            "batching": mode,
            "prompts": stats.written,
            "tokens": stats.tokens,
            "truncated_replies": stats.truncated_replies,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(stats.tokens / seconds, 2),
        }
        rows.append(row)
        print(
            f"{mode:<12}{stats.written:>8}{stats.tokens:>9}{stats.truncated_replies:>6}{seconds:>9.1f}"
            f"{row['tokens_per_s']:>9.1f}",
            flush=True,
        )
    result = {
        "target": name,
        "hardware": hardware_description(model.device, model.dtype),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    }
    if {"static", "continuous"} <= set(replies):
        by = {r["batching"]: r for r in rows}
        result["ratio_continuous_over_static"] = round(
            by["continuous"]["tokens_per_s"] / by["static"]["tokens_per_s"], 3
        )
        same = sum(replies["static"][sid] == text for sid, text in replies["continuous"].items())
        result["identical_replies"] = f"{same}/{len(replies['continuous'])}"
        print(
            f"\ncontinuous / static: {result['ratio_continuous_over_static']:.2f}x; identical replies "
            f"{result['identical_replies']}"
        )
    print(result["hardware"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
