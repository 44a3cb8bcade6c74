"""Issue 3's GPU check: train the full EAGLE-3 recipe on one GPU inside a fixed time, bring the head back.

A lent GPU comes with minutes, not hours, and a cosine schedule must know its length in advance. So
``train`` first times a few steps of the very recipe (same shapes: with ``data.pack`` every micro-batch
is batch_size x max_length tokens, so a few steps on a slice of the data give the step time), then
sets ``trainer.max_steps`` to what fits in ``--minutes`` and trains, with ``trainer.max_time`` as a
safety net. It records tokens/s and model FLOP utilisation of the real run.

A device call returns at most 16 MiB a file; ``pack`` and ``unpack`` (``draftsmith.export.transport``)
bring the head back in parts small enough.

    python bench/gpu_eagle3.py train configs/smollm2_eagle3.yaml --minutes 5 --out $OUT/train.json \\
        --output.dir=runs/gpu_eagle3 --data.pack=true
    python bench/gpu_eagle3.py pack runs/gpu_eagle3/draft $OUT/head
    python bench/gpu_eagle3.py unpack HEAD_PARTS runs/gpu_eagle3/draft        # back here, on the CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

from draftsmith.export.transport import pack, unpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import StepTimer, peak_flops  # noqa: E402


class PrintProgress(L.Callback):
    """One line every ``every`` steps (a device call's log has room for lines, not progress bars)."""

    def __init__(self, every: int):
        self.every, self.start, self.last = every, time.perf_counter(), -1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # with gradient accumulation several micro-batches share a step
        if step % self.every == 0 and step != self.last:
            self.last = step
            loss = trainer.callback_metrics.get("train/loss")
            print(f"[gpu_eagle3] step {step}/{trainer.max_steps}  loss {float(loss):.4f}  "
                  f"{time.perf_counter() - self.start:.0f} s", flush=True)  # fmt: skip


def step_shape(config) -> dict:
    """What the step time depends on: a probe timed for another shape is not reused."""
    t, d = config.trainer, config.data
    return {
        "mode": config.mode, "target_dtype": config.target.dtype, "precision": t.precision,
        "batch_size": t.batch_size, "grad_accum": t.grad_accum, "max_length": d.max_length, "pack": d.pack,
        "draft": {"kind": config.draft.kind, **config.draft.options},
    }  # fmt: skip


def step_seconds(config, target, probe_steps: int) -> dict:
    """Seconds per optimizer step of ``config``, from ``probe_steps`` steps on a slice of its data."""
    from draftsmith.train.loop import train

    if not config.data.pack:
        print("[gpu_eagle3] data.pack is false: batches vary in length, so the probe's step time is a rough guess",
              flush=True)  # fmt: skip
    t = config.trainer
    rows = probe_steps * t.batch_size * t.grad_accum
    with tempfile.TemporaryDirectory() as tmp:
        probe = copy.deepcopy(config)
        probe.output.dir = tmp
        probe.trainer.max_steps = probe.trainer.val_every = probe.trainer.ckpt_every = probe_steps
        probe.trainer.max_time = None
        probe.data.limit = rows * 4 + 4  # packed rows hold a few conversations each
        probe.data.heldout = 4
        timer = StepTimer()
        train(probe, target=target, callbacks=[timer], enable_progress_bar=False)
    micro = timer.seconds / max(1, probe_steps * t.grad_accum - 1)  # the first micro-batch is a warm-up
    return {
        "seconds_per_step": micro * t.grad_accum,
        "tokens_per_s": timer.tokens / timer.seconds,
        "shape": step_shape(config),
    }


def run_train(args, overrides: list[str]) -> None:
    from draftsmith.decode.target import load_target
    from draftsmith.eval.report import write_json
    from draftsmith.train.config import load_config
    from draftsmith.train.distributed import target_device

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


def fit_and_train(
    recipe: str,
    overrides: list[str],
    target,
    minutes: float,
    rate_file: str | None = None,
    probe_steps: int = 8,
    max_steps: int | None = None,
    probe_only: bool = False,
) -> dict | None:
    """Time ``probe_steps`` steps of the recipe (or read them from ``rate_file``), then train the steps
    that fit in ``minutes``; the run's report (None with ``probe_only``)."""
    from draftsmith.eval.report import hardware_description
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train

    config = load_config(recipe, overrides)
    rate_file = Path(rate_file) if rate_file else None
    saved = json.loads(rate_file.read_text()) if rate_file is not None and rate_file.exists() else None
    if saved is not None and saved.get("shape") == json.loads(json.dumps(step_shape(config))):
        probe = saved
        print(f"[gpu_eagle3] step time from {rate_file}: {probe['seconds_per_step']:.3f} s", flush=True)
    else:
        if saved is not None:
            print(f"[gpu_eagle3] {rate_file} was timed for another step shape; timing this one", flush=True)
        probe = step_seconds(config, target, probe_steps)
        print(f"[gpu_eagle3] probe: {probe['seconds_per_step']:.3f} s/step, {probe['tokens_per_s']:.0f} tok/s",
              flush=True)  # fmt: skip
        if rate_file is not None:
            rate_file.parent.mkdir(parents=True, exist_ok=True)
            rate_file.write_text(json.dumps(probe))
    if probe_only:
        return None
    steps = max(1, math.floor(minutes * 60 / probe["seconds_per_step"]))
    if max_steps:
        steps = min(steps, max_steps)
    fitted = [
        f"--trainer.max_steps={steps}",
        f"--trainer.max_time={minutes * 1.1}",
        f"--trainer.ckpt_every={max(1, steps // 4)}",
        f"--trainer.val_every={steps}",
        f"--optim.warmup_steps={max(1, min(config.optim.warmup_steps, steps // 20))}",
    ]
    config = load_config(recipe, overrides + fitted)
    print(f"[gpu_eagle3] training {steps} steps (~{minutes:.1f} min)", flush=True)
    timer = StepTimer()
    began = time.perf_counter()
    result = train(
        config,
        target=target,
        callbacks=[timer, PrintProgress(max(1, steps // 20))],
        enable_progress_bar=False,
    )
    wall = time.perf_counter() - began
    per_s = timer.tokens / timer.seconds
    peak = peak_flops(timer.device)
    return {
        "recipe": recipe,
        "overrides": overrides + fitted,
        "hardware": hardware_description(target.device, target.dtype),
        "date": time.strftime("%Y-%m-%d"),
        "probe": probe,
        "steps": result.steps,
        "train_wall_seconds": wall,
        "step_seconds": timer.seconds,
        "tokens": timer.tokens,
        "tokens_per_s": per_s,
        "model_flops_per_token": timer.flops_per_token,
        "mfu": timer.flops_per_token * per_s / peak if peak and timer.flops_per_token else None,
        "val": result.val,
        "draft_dir": str(result.draft_dir),
    }


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
