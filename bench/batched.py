"""Batched decoding throughput: tokens/s over a prompt set at batch 1, 4, 8, ... for the target alone and drafts.

Offline evaluation decodes many prompts; ``generate_batch`` (decode/batched.py) runs several at once,
each row accepting its own number of draft tokens. For every (method, batch size) this decodes the
same prompts (first turns of the dev set, round-robin over categories) in chunks of that size, greedy,
and reports total new tokens / total seconds and τ (``benchlib.timed.batched_row``). Every
sequence is checked token for token against the target alone decoded one prompt at a time. A short
untimed warm-up runs every method first.

    python bench/batched.py --limit 16 --max-new-tokens 64 --batch-sizes 1 4 8
"""

from __future__ import annotations

import argparse

from benchlib.records import bench_record, write_json
from benchlib.timed import batched_row, decode_batched, decode_each

from draftsmith.decode.cpu_kernels import pack_for_decoding
from draftsmith.decode.target import load_target
from draftsmith.drafts import build_drafter
from draftsmith.drafts.base import NGRAM
from draftsmith.eval.prompts import load_prompts, render


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--prompts", default="builtin:dev_prompts")
    p.add_argument("--limit", type=int, default=16, help="prompts decoded per method and batch size")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--draft", action="append", default=None, help="draft spec (default: ngram); repeatable")
    p.add_argument("--k", type=int, default=4, help="draft tokens per row and step")
    p.add_argument("--cpu-kernels", choices=["packed", "stock"], default="packed")
    p.add_argument("--out", default="bench/results/batched.json")
    args = p.parse_args()

    target = load_target(args.target, device="auto", dtype="float32")
    specs = args.draft or [NGRAM]
    drafters = {spec: build_drafter(spec, target) for spec in specs}
    if args.cpu_kernels == "packed":
        pack_for_decoding(target.model, *drafters.values())
    prompts = [
        render(target.tokenizer, [{"role": "user", "content": q.turns[0]}])
        for q in load_prompts(args.prompts, args.limit, order="round-robin")
    ]
    reference = decode_each(target, prompts, None, 0, args.max_new_tokens).outputs

    methods = {"target alone": (None, 0), **{spec: (d, args.k) for spec, d in drafters.items()}}
    for drafter, k in methods.values():  # warm-up: kernels and allocator at every batch size
        for size in args.batch_sizes:
            decode_batched(target, prompts[:size], drafter, k, size, max_new_tokens=8)

    rows = []
    print(f"{'method':<16}{'batch':>6}{'tok/s':>9}{'vs b=1 alone':>14}{'τ':>7}{'exact':>9}", flush=True)
    base = None
    for size in args.batch_sizes:
        for name, (drafter, k) in methods.items():
            row = batched_row(target, prompts, reference, drafter, k, size, args.max_new_tokens)
            base = base or row["tokens_per_s"]
            row = {"method": name, **row, "vs_batch1_target_alone": row["tokens_per_s"] / base}
            rows.append(row)
            print(
                f"{name:<16}{size:>6}{row['tokens_per_s']:>9.1f}{row['vs_batch1_target_alone']:>13.2f}x"
                f"{row['tau']:>7.2f}{row['exact']:>5}/{len(prompts)}",
                flush=True,
            )
    write_json(args.out, bench_record(target, vars(args), rows=rows))


if __name__ == "__main__":
    main()
