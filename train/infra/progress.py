"""One progress bar over optimizer steps, the unit a run is sized in (``trainer.max_steps``).

Lightning's own bars count batches per epoch; a run here has no epochs to speak of (``max_epochs=-1``,
the sampler restarts the data as often as needed), so they read "Epoch 49/-2 ... 48/24".
"""

from __future__ import annotations

import logging

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
