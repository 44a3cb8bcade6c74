"""What a run shows of its progress: one line per stage of a long job, and one bar over optimizer steps.

``StageLine``: a stage of data preparation (read, render + mask, pack) is one bar while it runs and one line
once it is done, saying what it made and what it skipped. ``StepProgress``: one bar over optimizer steps, the
unit a run is sized in (``trainer.max_steps``); Lightning's own bars count batches per epoch, and a run here has
no epochs to speak of (``max_epochs=-1``, the sampler restarts the data as often as needed), so they read
"Epoch 49/-2 ... 48/24". ``quiet_loading``: transformers' bar over the weights of one load off, and
``quiet_said_already``: notices draftsmith's own lines already give dropped.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L
import torch
from tqdm.auto import tqdm

SAID_ALREADY = {
    "lightning.pytorch.utilities.rank_zero": "`Trainer.fit` stopped: `max_steps=",
    "DeepSpeed": "Setting accelerator to CPU",
}
"""Logger -> the start of a notice draftsmith's own lines already give: the run ending at the steps it was
sized in (its summary: "trained N steps"); DeepSpeed falling back to the CPU on a machine without CUDA,
printed when a checkpoint is first saved ("training on cpu")."""


class _Drop(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def quiet_said_already() -> None:
    """Drop the notices of ``SAID_ALREADY`` (once per process; DeepSpeed's only where CUDA is absent, as its
    hint about an undetected GPU would otherwise matter)."""
    for name, start in SAID_ALREADY.items():
        logger = logging.getLogger(name)
        if name == "DeepSpeed" and torch.cuda.is_available():
            continue
        if not any(isinstance(f, _Drop) and f.start == start for f in logger.filters):
            logger.addFilter(_Drop(start))


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' "Loading weights" bar off for a block (the target's load, said by draftsmith's own
    lines); restored after."""
    import transformers

    hf_logging = transformers.utils.logging
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class StageLine:
    """One stage of a long job shown as one line: a bar while it runs, then
    ``[draftsmith] data: render + mask: 12,999 conversations -> 12,907 rows in 21 s (skipped 92 ...)``.

    Use it as a context manager; ``update(n)`` counts the work done, ``note(text)`` keeps a remark (what the
    stage skipped) for the closing line, ``done(result)`` says what the stage made. A stage left by an
    exception prints nothing: the error says what happened.
    """

    def __init__(self, job: str, stage: str, total: int | None = None, unit: str = "rows"):
        self.label = f"[draftsmith] {job}: {stage}"
        self.bar = tqdm(total=total, desc=self.label, unit=f" {unit}", leave=False, dynamic_ncols=True)
        self.notes: list[str] = []
        self.result: str | None = None
        self.start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def done(self, result: str) -> None:
        self.result = result

    def __enter__(self) -> StageLine:
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.bar.close()
        if error is not None:
            return
        seconds = time.perf_counter() - self.start
        line = f"{self.label}: {self.result or 'done'} in {seconds:.0f} s"
        if self.notes:
            line += f" ({'; '.join(self.notes)})"
        print(line, file=sys.stdout, flush=True)


class StepProgress(L.Callback):
    """``train  37/200 steps [01:12<05:01, loss=2.31, val τ=1.43]``: a resumed run starts at its step."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def on_train_start(self, trainer, module) -> None:
        if trainer.is_global_zero:
            self.bar = tqdm(total=trainer.max_steps, initial=trainer.global_step, desc="train", unit="step",
                            dynamic_ncols=True)  # fmt: skip

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.bar is None:
            return
        self.bar.update(trainer.global_step - self.bar.n)
        metrics = trainer.progress_bar_metrics
        shown = {k.split("/")[-1].replace("tau", "val τ"): f"{v:.3g}" for k, v in metrics.items() if k in
                 ("train/loss", "val/tau")}  # fmt: skip
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        if trainer.global_step >= trainer.max_steps:  # closed before Lightning says why fit stops
            self.on_train_end(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_exception(self, trainer, module, exception) -> None:
        self.on_train_end(trainer, module)  # closed before the error's line is printed, not after it
