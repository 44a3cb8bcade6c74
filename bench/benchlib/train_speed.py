"""How fast the one training loop runs, and training fitted to a wall-time budget.

``StepTimer`` times the training steps alone (teacher + draft forward/backward + optimizer) and counts
the model FLOPs of the first one (``torch.utils.flop_counter``: every matmul and attention of the draft's
forward and backward and, online, the frozen target's forward), which with ``peak_flops`` gives the
model FLOP utilisation on a GPU. A lent GPU comes with minutes, not hours, and a cosine schedule must
know its length in advance: ``fit_and_train`` times a few steps of the very recipe, sets
``trainer.max_steps`` to what fits in the minutes and trains, with ``trainer.max_time`` as a safety net.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.flop_counter import FlopCounterMode

from draftsmith.decode.target import Target
from draftsmith.eval.report import hardware_description
from draftsmith.train.objective import Batch

PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100": 756e12,  # datasheet
    "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12, "MI300X": 1307e12,  # datasheet
}  # fmt: skip
"""Peak dense bf16 tensor FLOP/s per device, from the vendors' datasheets (no sparsity)."""


def peak_flops(device: torch.device) -> float | None:
    """The device's peak dense bf16 FLOP/s (None on the CPU or for a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


class StepTimer(L.Callback):
    """Wall time and real tokens of every training step after the first; FLOPs of the first."""

    def __init__(self) -> None:
        self.seconds, self.tokens, self._start = 0.0, 0, 0.0
        self.device = torch.device("cpu")
        """Where the draft trained (offline, the target has gone back to the CPU by then)."""
        self.flops_per_token: float | None = None
        self._counter: FlopCounterMode | None = None
        self._first_positions = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        batch = batch if isinstance(batch, Batch) else batch[0]
        self.device = module.device
        if self.flops_per_token is None and self._counter is None:  # warm-up step: count, do not time
            self._first_positions = batch.attention_mask.numel()
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
            return
        self.tokens += int(batch.attention_mask.sum())
        self._sync(module)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            # per position of the padded batch: padding is wasted work, so MFU counts real tokens only
            self.flops_per_token = self._counter.get_total_flops() / max(1, self._first_positions)
            self._counter = None
            return
        self._sync(module)
        self.seconds += time.perf_counter() - self._start

    @staticmethod
    def _sync(module) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def mfu(self, peak: float | None = None) -> float | None:
        """Model FLOP utilisation of the timed steps against ``peak`` (default: the device's; None when unknown)."""
        peak = peak or peak_flops(self.device)
        if not peak or not self.flops_per_token or not self.seconds:
            return None
        return self.flops_per_token * self.tokens / self.seconds / peak


class PrintProgress(L.Callback):
    """One line every ``every`` steps (a device call's log has room for lines, not progress bars)."""

    def __init__(self, every: int):
        self.every, self.start, self.last = every, time.perf_counter(), -1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # with gradient accumulation several micro-batches share a step
        if step % self.every == 0 and step != self.last:
            self.last = step
            loss = trainer.callback_metrics.get("train/loss")
            print(f"[train] step {step}/{trainer.max_steps}  loss {float(loss):.4f}  "
                  f"{time.perf_counter() - self.start:.0f} s", flush=True)  # fmt: skip


def step_shape(config) -> dict:
    """What the step time depends on: a probe timed for another shape is not reused."""
    t, d = config.trainer, config.data
    return {
        "mode": config.mode, "target_dtype": config.target.dtype, "precision": t.precision,
        "batch_size": t.batch_size, "grad_accum": t.grad_accum, "max_length": d.max_length, "pack": d.pack,
        "draft": {"kind": config.draft.kind, **config.draft.options},
    }  # fmt: skip


def step_seconds(config, target: Target, probe_steps: int) -> dict:
    """Seconds per optimizer step of ``config``, from ``probe_steps`` steps on a slice of its data."""
    from draftsmith.train.loop import train

    if not config.data.pack:
        print("[train] data.pack is false: batches vary in length, so the probe's step time is a rough guess",
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


def fit_and_train(
    recipe: str,
    overrides: list[str],
    target: Target,
    minutes: float,
    rate_file: str | Path | None = None,
    probe_steps: int = 8,
    max_steps: int | None = None,
    probe_only: bool = False,
) -> dict | None:
    """Time ``probe_steps`` steps of the recipe (or read them from ``rate_file``, when timed for the same
    step shape), then train the steps that fit in ``minutes``; the run's report (None with ``probe_only``)."""
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train

    config = load_config(recipe, overrides)
    rate_file = Path(rate_file) if rate_file else None
    saved = json.loads(rate_file.read_text()) if rate_file is not None and rate_file.exists() else None
    if saved is not None and saved.get("shape") == json.loads(json.dumps(step_shape(config))):
        probe = saved
        print(f"[train] step time from {rate_file}: {probe['seconds_per_step']:.3f} s", flush=True)
    else:
        if saved is not None:
            print(f"[train] {rate_file} was timed for another step shape; timing this one", flush=True)
        probe = step_seconds(config, target, probe_steps)
        print(f"[train] probe: {probe['seconds_per_step']:.3f} s/step, {probe['tokens_per_s']:.0f} tok/s",
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
    print(f"[train] training {steps} steps (~{minutes:.1f} min)", flush=True)
    timer = StepTimer()
    began = time.perf_counter()
    result = train(
        config,
        target=target,
        callbacks=[timer, PrintProgress(max(1, steps // 20))],
        enable_progress_bar=False,
    )
    wall = time.perf_counter() - began
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
        "tokens_per_s": timer.tokens / timer.seconds,
        "model_flops_per_token": timer.flops_per_token,
        "mfu": timer.mfu(),
        "val": result.val,
        "draft_dir": str(result.draft_dir),
    }
