"""What the dataset cache saves at each start: the data stage of ``draftsmith train`` (load, render with the
chat template, mask, pack, split) timed on a synthetic conversation set, first with an empty cache (what
every start cost before the cache) and then as a restart reads it back.

The conversations are generated deterministically (--seed): 1 to 4 turns of user and assistant text drawn
from a fixed word list, in ShareGPT's shape, written once into --work. The tokenizer and chat template are
the target's (default: the bundled SmolLM2-135M-Instruct; only its tokenizer loads). The data stage is
``train.loop.prepare_datasets``, the very function a training run calls; the restart is timed --repeats
times in fresh processes' worth of state (a new call, the cache files in the page cache as after a requeue
on the same node).

    python bench/dataset_cache.py --conversations 100000 --out bench/results/dataset_cache.json
    python bench/dataset_cache.py --conversations 2000 --out bench/results/dataset_cache_2k.json  # a check
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

WORDS = (
    "the a model token draft target layer cache speed decode verify accept reject batch step loss rank "
    "train data chat template render pack row sequence head norm weight memory disk restart start time "
    "question answer explain why how what when which number code function return value list map key"
).split()


def synthetic_conversations(path: Path, n: int, seed: int) -> Path:
    """``n`` ShareGPT records of 1-4 exchanges, each message 5-120 words, the same for the same seed."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            turns = []
            for _ in range(rng.randint(1, 4)):
                for role in ("human", "gpt"):
                    words = rng.choices(WORDS, k=rng.randint(5, 120))
                    turns.append({"from": role, "value": f"{i} " + " ".join(words)})
            f.write(json.dumps({"conversations": turns}) + "\n")
    return path


def timed_stage(config, tokenizer) -> tuple[float, int]:
    from draftsmith.train.loop import prepare_datasets

    start = time.perf_counter()
    train_rows, heldout_rows = prepare_datasets(config, tokenizer)
    return time.perf_counter() - start, len(train_rows) + len(heldout_rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default="smollm2-135m-instruct", help="whose tokenizer and chat template")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--no-pack", action="store_true", help="time unpacked rows (packing is on by default)")
    p.add_argument("--repeats", type=int, default=3, help="restarts timed (the median is reported)")
    p.add_argument("--work", type=Path, default=Path("runs/dataset_cache_bench"))
    p.add_argument("--out", type=Path, default=Path("bench/results/dataset_cache.json"))
    args = p.parse_args(argv)

    from benchlib.records import provenance, write_json

    from draftsmith.loading import target_tokenizer
    from draftsmith.train.config import load_config

    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / f"synthetic_{args.conversations}_seed{args.seed}.jsonl"
    if not data.exists():
        synthetic_conversations(data, args.conversations, args.seed)
    tokenizer, _, name = target_tokenizer(args.target)
    cache = args.work / "dataset_cache"
    shutil.rmtree(cache, ignore_errors=True)  # the first start finds no cache
    config = load_config(None, [
        f"--target.spec={args.target}", f"--data.paths=[{data}]", f"--data.max_length={args.max_length}",
        f"--data.pack={str(not args.no_pack).lower()}", f"--data.cache_dir={cache}",
        f"--output.dir={args.work / 'run'}",
    ])  # fmt: skip
    first, rows = timed_stage(config, tokenizer)
    restarts = sorted(timed_stage(config, tokenizer)[0] for _ in range(args.repeats))
    restart = restarts[len(restarts) // 2]
    disk = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    result = {
        "target": name,
        "settings": {
            "conversations": args.conversations,
            "seed": args.seed,
            "max_length": args.max_length,
            "pack": not args.no_pack,
            "repeats": args.repeats,
        },  # fmt: skip
        "rows": rows,
        "data_bytes": data.stat().st_size,
        "cache_bytes": disk,
        "first_start_s": round(first, 3),
        "restart_s": round(restart, 3),
        "restarts_s": [round(t, 3) for t in restarts],
        "speedup": round(first / restart, 1),
        "provenance": provenance(seed=args.seed),
    }
    print(
        f"\ndata stage of `draftsmith train`, {args.conversations:,} synthetic conversations, {name}'s template,"
    )
    print(
        f"max_length {args.max_length}, {'packed' if not args.no_pack else 'unpacked'} into {rows:,} rows\n"
    )
    print(f"| {'start':<32} | {'seconds':>8} |\n|{'-' * 34}|{'-' * 10}|")
    print(f"| {'first (render, pack, store)':<32} | {first:8.2f} |")
    print(f"| {'restart (read the cache, median)':<32} | {restart:8.2f} |")
    print(f"\ncache entry: {disk / 2**20:.1f} MiB for {data.stat().st_size / 2**20:.1f} MiB of JSONL; "
          f"restart {first / restart:.1f}x faster")  # fmt: skip
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
