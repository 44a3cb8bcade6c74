"""Training throughput of the one loop: tokens/s of the training steps, per draft kind and mode.

Runs a few steps of each setting on the same data and reports the real (non-padding) tokens per
second per device of the training steps alone (teacher + draft forward/backward + optimizer), and
the wall time of everything else (loading, the offline feature cache, validation). The first step
is a warm-up, left out of the timing; its FLOPs are counted (``torch.utils.flop_counter``: every
matmul and attention of the draft's forward and backward and, online, the frozen target's forward),
which gives model FLOPs per token and, on a GPU, the model FLOP utilisation (MFU) against the
device's peak dense bf16 FLOP/s (``benchlib.train_speed``). Prints a table, writes JSON.

    python bench/train_throughput.py --steps 20 --out bench/results/train_throughput.json
    python bench/train_throughput.py --precision bf16-mixed --target-dtype bfloat16   # on a GPU
"""

from __future__ import annotations

import argparse
import tempfile
import time

from benchlib.records import bench_record, write_json
from benchlib.train_speed import StepTimer, peak_flops

from draftsmith.decode.target import load_target
from draftsmith.train.config import load_config
from draftsmith.train.loop import train

# name -> (recipe, overrides); every run also gets the same data, length, batch and step count
SETTINGS = {
    "eagle3 online": ("configs/quickstart.yaml", ["--mode=online"]),
    "eagle3 offline": ("configs/quickstart.yaml", ["--mode=offline"]),
    "distill online (8 layers, JSD)": ("configs/smollm2_distill.yaml", ["--mode=online"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", default="configs/quickstart.yaml", help="base recipe (data, target, optim)"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default="bench/results/train_throughput.json")
    parser.add_argument("--precision", default=None, help="trainer.precision (e.g. bf16-mixed on a GPU)")
    parser.add_argument("--target-dtype", default=None, help="target.dtype (e.g. bfloat16 on a GPU)")
    parser.add_argument(
        "--target", default=None, help="target.spec (e.g. a random-init model of the same shape: same FLOPs)"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the device's peak bf16 TFLOP/s, if not in the table"
    )
    args = parser.parse_args()
    extra = [f"--trainer.precision={args.precision}"] if args.precision else []
    extra += [f"--target.dtype={args.target_dtype}"] if args.target_dtype else []
    extra += [f"--target.spec={args.target}"] if args.target else []

    rows = {}
    target = None
    for name, (recipe, overrides) in SETTINGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            config = load_config(
                recipe,
                [
                    *overrides,
                    f"--output.dir={tmp}",
                    f"--trainer.max_steps={args.steps}",
                    f"--trainer.batch_size={args.batch_size}",
                    f"--trainer.val_every={args.steps}",
                    f"--trainer.ckpt_every={args.steps}",
                    f"--data.limit={args.steps * args.batch_size + 16}",
                    "--data.max_length=512",
                    "--data.heldout=16",
                    *extra,
                ],
            )
            if target is None:
                target = load_target(config.target.spec, config.target.device, config.target.dtype)
            timer = StepTimer()
            start = time.perf_counter()
            train(config, target=target, callbacks=[timer], enable_progress_bar=False)
            wall = time.perf_counter() - start
        per_device = timer.tokens / timer.seconds  # one process, one device
        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(timer.device)
        mfu = timer.mfu(peak)
        rows[name] = {
            "steps": args.steps,
            "timed_steps": args.steps - 1,
            "tokens": timer.tokens,
            "step_seconds": timer.seconds,
            "tokens_per_s_per_device": per_device,
            "model_flops_per_token": timer.flops_per_token,
            "peak_bf16_flops": peak,
            "mfu": mfu,
            "other_seconds": wall - timer.seconds,
        }
        shown = f"MFU {100 * mfu:5.1f}%" if mfu is not None else "MFU -"
        print(f"{name:32s} {per_device:8.0f} tok/s/device   {timer.flops_per_token / 1e9:7.2f} GFLOP/token   "
              f"{shown}   ({timer.tokens} tokens, {timer.seconds:.0f} s; {wall - timer.seconds:.0f} s outside steps)",
              flush=True)  # fmt: skip
    write_json(args.out, bench_record(target, vars(args), runs=rows))


if __name__ == "__main__":
    main()
