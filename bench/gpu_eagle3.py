"""Issue 3's GPU check: train the full EAGLE-3 recipe on one GPU inside a fixed time, bring the head back.

A lent GPU comes with minutes, not hours, and a cosine schedule must know its length in advance. So
``train`` first times a few steps of the very recipe (same shapes: with ``data.pack`` every micro-batch
is batch_size x max_length tokens, so a few steps on a slice of the data give the step time), then
sets ``trainer.max_steps`` to what fits in ``--minutes`` and trains, with ``trainer.max_time`` as a
safety net (``benchlib.train_speed.fit_and_train``). It records tokens/s and model FLOP
utilisation of the real run.

A device call returns at most 16 MiB a file; ``pack`` and ``unpack`` (``benchlib.transport``)
bring the head back in parts small enough.

    python bench/gpu_eagle3.py train configs/smollm2_eagle3.yaml --minutes 5 --out $OUT/train.json \\
        --output.dir=runs/gpu_eagle3 --data.pack=true
    python bench/gpu_eagle3.py pack runs/gpu_eagle3/draft $OUT/head
    python bench/gpu_eagle3.py unpack HEAD_PARTS runs/gpu_eagle3/draft        # back here, on the CPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchlib.train_speed import fit_and_train
from benchlib.transport import pack, unpack


def run_train(args, overrides: list[str]) -> None:
    from benchlib.records import write_json

    from draftsmith.decode.target import load_target
    from draftsmith.train.config import load_config
    from draftsmith.train.infra.distributed import target_device

    start = time.perf_counter()
    tc = load_config(args.recipe, overrides).target
    target = load_target(tc.spec, device=target_device(tc.device), dtype=tc.dtype)
    print(f"[gpu_eagle3] target loaded in {time.perf_counter() - start:.0f} s", flush=True)
    report = fit_and_train(
        args.recipe,
        overrides,
        target,
        args.minutes,
        args.rate_file,
        args.probe_steps,
        args.max_steps,
        args.probe_only,
    )
    if report is None:
        return
    if args.out:
        write_json(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "overrides"}, indent=2), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="time a few steps, then train what fits in --minutes")
    t.add_argument("recipe")
    t.add_argument("--minutes", type=float, default=5.0, help="training time to fit the steps to")
    t.add_argument("--probe-steps", type=int, default=8)
    t.add_argument("--max-steps", type=int, default=None, help="at most this many steps")
    t.add_argument("--rate-file", default=None, help="read the step time from here, or write the probe's")
    t.add_argument("--probe-only", action="store_true", help="time the steps and stop")
    t.add_argument("--out", default=None, help="JSON report")
    k = sub.add_parser("pack", help="the head without the target's embedding, bf16, in small parts")
    k.add_argument("draft_dir", type=Path)
    k.add_argument("out", type=Path)
    k.add_argument("--max-mb", type=float, default=15.0)
    u = sub.add_parser("unpack", help="rebuild a float32 head directory from pack's parts")
    u.add_argument("parts_dir", type=Path)
    u.add_argument("draft_dir", type=Path)
    u.add_argument("--target", default="smollm2-135m-instruct")
    args, rest = p.parse_known_args()
    if args.command == "train":
        run_train(args, rest)
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    elif args.command == "pack":
        for path in pack(args.draft_dir, args.out, args.max_mb):
            print(f"{path}  {path.stat().st_size / 1e6:.1f} MB")
    else:
        from draftsmith.decode.target import load_target

        target = load_target(args.target, device="cpu", dtype="float32")
        print(unpack(args.parts_dir, args.draft_dir, target))


if __name__ == "__main__":
    main()
