"""Training throughput of the one loop: tokens/s of the training steps, per draft kind and mode.

Runs a few steps of each setting on the same data and reports the real (non-padding) tokens per
second of the training steps alone (teacher + draft forward/backward + optimizer), and the wall
time of everything else (loading, the offline feature cache, validation). Prints a table, writes JSON.

    python bench/train_throughput.py --steps 20 --out bench/results/train_throughput.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import lightning as L

from draftsmith.decode.target import load_target
from draftsmith.eval.report import hardware_description
from draftsmith.train.config import load_config
from draftsmith.train.loop import train
from draftsmith.train.objective import Batch

# name -> (recipe, overrides); every run also gets the same data, length, batch and step count
SETTINGS = {
    "eagle3 online": ("configs/quickstart.yaml", ["--mode=online"]),
    "eagle3 offline": ("configs/quickstart.yaml", ["--mode=offline"]),
    "distill online (8 layers, JSD)": ("configs/smollm2_distill.yaml", ["--mode=online"]),
}


class StepTimer(L.Callback):
    """Wall time and real tokens of every training step."""

    def __init__(self) -> None:
        self.seconds, self.tokens, self._start = 0.0, 0, 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        batch = batch if isinstance(batch, Batch) else batch[0]
        self.tokens += int(batch.attention_mask.sum())
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.seconds += time.perf_counter() - self._start


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
    args = parser.parse_args()

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
                ],
            )
            if target is None:
                target = load_target(config.target.spec, config.target.device, config.target.dtype)
            timer = StepTimer()
            start = time.perf_counter()
            train(config, target=target, callbacks=[timer], enable_progress_bar=False)
            wall = time.perf_counter() - start
        rows[name] = {
            "steps": args.steps,
            "tokens": timer.tokens,
            "step_seconds": timer.seconds,
            "tokens_per_s": timer.tokens / timer.seconds,
            "other_seconds": wall - timer.seconds,
        }
        print(f"{name:28s} {timer.tokens / timer.seconds:8.0f} tok/s in steps   "
              f"({timer.tokens} tokens, {timer.seconds:.0f} s; {wall - timer.seconds:.0f} s outside steps)",
              flush=True)  # fmt: skip
    result = {
        "target": target.name,
        "settings": vars(args),
        "hardware": hardware_description(target.device, target.dtype),
        "date": time.strftime("%Y-%m-%d"),
        "runs": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
