"""Peak memory of reading a Hub-layout dataset through ``hf:`` sources: ``streaming=true&take=N`` against
the whole split, on local folders of parquet shards of growing size (same rows, more shards).

Each reading runs in its own process (``draftsmith.train.corpus.conversations.iter_conversations``, the path training
and ``draftsmith data`` use) and reports its peak resident memory; the datasets cache is a fresh
temporary folder, so the non-streaming rows include converting the shards to Arrow once.

    python bench/hub_streaming_memory.py --out bench/results/hub_streaming_memory.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from benchlib.records import write_json

from draftsmith.eval.report import hardware_description

PROBE = """
import resource, sys
from draftsmith.train.corpus.conversations import iter_conversations
rows = sum(1 for _ in iter_conversations(sys.argv[1]))
print(rows, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def write_set(folder: Path, shards: int, rows_per_shard: int, reply_bytes: int) -> int:
    """``shards`` parquet files of distinct random replies; returns their size in bytes."""
    (folder / "data").mkdir(parents=True)
    for i in range(shards):
        rows = [
            {"messages": [{"role": "user", "content": f"question {i}-{j}"},
                          {"role": "assistant", "content": os.urandom(reply_bytes // 2).hex()}]}
            for j in range(rows_per_shard)
        ]  # fmt: skip
        pq.write_table(pa.Table.from_pylist(rows), folder / "data" / f"train-{i:05d}-of-{shards:05d}.parquet")
    return sum(f.stat().st_size for f in (folder / "data").iterdir())


def peak(spec: str, cache: Path) -> tuple[int, int, float]:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache)}
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, spec], capture_output=True, text=True, env=env, check=True
    )
    rows, rss = map(int, out.stdout.split())
    return rows, rss, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, nargs="+", default=[1, 10, 40], help="dataset sizes, in shards")
    p.add_argument("--rows-per-shard", type=int, default=1000)
    p.add_argument("--reply-bytes", type=int, default=3000)
    p.add_argument("--take", type=int, default=200)
    p.add_argument("--out", default="bench/results/hub_streaming_memory.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shards in args.shards:
            folder = Path(tmp) / f"set{shards}"
            size = write_set(folder, shards, args.rows_per_shard, args.reply_bytes)
            for how, query in (("stream, take", f"?streaming=true&take={args.take}"), ("whole split", "")):
                n, rss, seconds = peak(f"hf:{folder}:train{query}", Path(tmp) / f"cache{shards}{bool(query)}")
                rows.append({"shards": shards, "dataset_mb": size / 1e6, "read": how, "rows": n,
                             "peak_rss_mb": rss / 1e6, "seconds": seconds})  # fmt: skip
                r = rows[-1]
                print(f"{shards:3d} shards {r['dataset_mb']:7.1f} MB  {how:<12} {n:7d} rows  "
                      f"peak {r['peak_rss_mb']:7.1f} MB  {seconds:5.1f} s", flush=True)  # fmt: skip
    write_json(args.out, {
        "hardware": hardware_description(torch.device("cpu"), torch.float32),
        "date": time.strftime("%Y-%m-%d"), "take": args.take, "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
