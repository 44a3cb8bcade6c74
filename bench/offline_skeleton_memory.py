"""What an offline run with a complete feature cache holds of its target: the whole model (what every rank
loaded before) against the skeleton (``load_target_skeleton``: the layers on the meta device, the embedding,
final norm and LM head read from the safetensors by name). Each load runs in a fresh process; its peak RSS over
the process's own before the load, every materialised weight touched, is the figure.

    python bench/offline_skeleton_memory.py --out bench/results/offline_skeleton_memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

TARGET = "smollm2-135m-instruct"


def measure(target: str, how: str, dtype: str) -> dict:
    """One load in this process: peak RSS before and after, and the bytes of weights it materialised."""
    import torch  # noqa: F401 (its own pages count before the load, as in a training process)

    from draftsmith.decode.target import load_target, load_target_skeleton

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if how == "whole":
        target_ = load_target(target, device="cpu", dtype=dtype)
    else:
        target_ = load_target_skeleton(target, "cpu", dtype)
    real = [p for p in target_.model.parameters() if not p.is_meta]
    for p in real:
        p.float().sum()  # every materialised page touched
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"how": how, "dtype": dtype, "peak_rss_before_mib": before / 1024, "peak_rss_mib": after / 1024,
            "increase_mib": (after - before) / 1024,
            "materialised_mib": sum(p.numel() * p.element_size() for p in real) / 2**20,
            "meta_parameters": sum(p.numel() for p in target_.model.parameters() if p.is_meta)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument(
        "--dtype", default="bfloat16", help="the dtype both loads use (training's bf16 by default)"
    )
    p.add_argument("--out", default="bench/results/offline_skeleton_memory.json")
    p.add_argument("--one", choices=("whole", "skeleton"), help=argparse.SUPPRESS)  # a child's own load
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.target, args.one, args.dtype)))
        return 0
    rows = []
    for how in ("whole", "skeleton"):
        cmd = [sys.executable, __file__, "--target", args.target, "--dtype", args.dtype, "--one", how]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\n{args.target}, {args.dtype}: peak RSS of one load in a fresh process\n")
    print("| load | materialised MiB | peak RSS increase MiB | parameters on meta |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['how']} | {r['materialised_mib']:.1f} | {r['increase_mib']:.1f} | {r['meta_parameters']:,} |"
        )
    from benchlib.records import provenance, write_json

    write_json(args.out, {"target": args.target, "settings": {"dtype": args.dtype}, "rows": rows,
                          "provenance": provenance(seed=None)})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
